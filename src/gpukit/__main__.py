"""``python -m gpukit`` is the ``gpukit`` command."""

from gpukit.cli import main

if __name__ == "__main__":
    main()
