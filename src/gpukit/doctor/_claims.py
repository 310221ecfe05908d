"""gpukit's claims and queue: a claim folder that cannot be used, claims nobody uses, planted files.

Fails when no GPU (or one GPU) can be claimed: the folder is another user's, a symlink, a file,
not sticky while others may write in it, or a GPU's lock entry was planted by another user.
Warns about claims held by a process whose account runs nothing on that GPU (stale or planted),
and tells when claims live in a per-user folder (they then keep only this user's jobs apart).
"""

from __future__ import annotations

import time

from gpukit.devices import CLAIM_DIR_ENV, read_claim_state
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding

__all__ = ["check_claims"]

_NAME = "gpu.claims"


def _held(label: str, owner: dict | None, folder: str) -> Finding:
    if owner is None or owner.get("pid") is None:
        return Finding(_NAME, "warn", f"{label} is claimed (its lock is held) by a process not visible here: a "
                       f"process in another container sharing {folder}", f"find it with `fuser -v {folder}/*.lock` "
                       "(on the host) and end it to free the GPU", {"owner": owner})
    run = f", run {owner['run']}" if owner.get("run") else ""
    rank = f" rank {owner['rank']}" if owner.get("rank") is not None else ""
    since = owner.get("since")
    age = "" if since is None else f" for {max(0.0, time.time() - since) / 60:.0f} min"
    user = f" ({owner['user']})" if owner.get("user") else ""
    return Finding(_NAME, "info", f"{label} is claimed by pid {owner['pid']}{user}{run}{rank}{age}", None,
                   {"pid": owner["pid"], "user": owner.get("user"), "run": owner.get("run")})


def check_claims(ctx: DoctorContext) -> list[Finding]:
    """The claim folder (``GPUKIT_CLAIM_DIR``, the shared one, or this user's), its claims and queue."""

    chosen = ctx.env.get(CLAIM_DIR_ENV) or None
    state = read_claim_state(ctx.gpus, chosen, named=CLAIM_DIR_ENV)
    details = {"claim_dir": state.folder, "shared": state.shared}
    if state.error is not None:
        fix = state.error.rsplit("; ", 1)[-1].rstrip(".") if "; " in state.error else None
        return [Finding(_NAME, "fail", f"{state.error.removeprefix('GPU claims: ')} `gpukit run` and claim_gpus "
                        "refuse it, so no GPU can be claimed", fix, details)]
    labels = {u.uuid: u.label for g in ctx.gpus for u in (g, *g.mig_devices) if u.uuid}
    findings = [_held(labels.get(uuid, uuid), owner, state.folder or "")
                for uuid, owner in state.owners.items() if not (owner and owner.get("blocked"))]
    for problem in state.problems:
        findings.append(Finding(_NAME, problem.severity, problem.what, problem.fix, {**details, **problem.details}))
    if state.queue:
        waiting = "; ".join(f"{t.user} wants {t.count} GPU{'s' if t.count != 1 else ''} (pid {t.pid})"
                            for t in state.queue[:5])
        findings.append(Finding(_NAME, "info", f"{len(state.queue)} job(s) wait for GPUs, first come first "
                                f"served: {waiting}", None, {**details, "waiting": len(state.queue)}))
    if state.notice:
        findings.append(Finding(_NAME, "info", state.notice.rsplit(". An administrator", 1)[0],
                                "an administrator can make a shared claim folder once: sudo gpukit claims setup",
                                details))
    if not findings:
        where = "shared by every user" if state.shared else "this user's own"
        findings.append(Finding(_NAME, "ok", f"no gpukit claim is held ({state.folder}, {where})", None, details))
    return findings
