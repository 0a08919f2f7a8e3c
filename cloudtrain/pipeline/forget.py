"""``cloudtrain down`` of one cluster: the verified teardown (:mod:`.teardown`), or, with
``--forget`` when the provider cannot be asked at all (its SDK or its credentials missing),
forgetting the local record without asking. A cluster the provider has nothing of can thus
always be forgotten: after the provider confirms (a plain ``down``), or on the user's word.
"""

from __future__ import annotations

from cloudtrain.cluster import cluster_lock
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, reached_nothing
from cloudtrain.pipeline import sweepout, teardown
from cloudtrain.pipeline.outputs import Unpulled
from cloudtrain.provider import registry
from cloudtrain.schema import ClusterRow


def down(env: Env, name: str, provider_name: str | None, *, forget: bool = False,
         unpulled: Unpulled = "pull") -> None:
    """Tear ``name`` down and verify with its provider (``provider_name``: by tag without a
    local record; ``unpulled``: what to do with outputs never pulled, as
    :func:`.teardown.down`). When the provider cannot be asked: with ``forget``, forget the cluster
    here; without it, the error says how to forget it."""
    row = env.state.get_cluster(name)
    pname = row.provider if row is not None else provider_name
    try:
        if pname is not None:
            registry.require_sdk(pname)   # exit 2 with the pip line, before anything
        if row is not None:               # a sweep's trials' outputs first (pipeline/sweepout.py)
            sweepout.before_down(env, name, unpulled)
        teardown.down(env, name, provider_name=provider_name, require_found=True,
                      unpulled=unpulled)
    except CloudtrainError as exc:
        if row is None or not reached_nothing(exc):
            raise
        if not forget:
            exc.hint = (exc.hint + " " if exc.hint else "") + (
                f"If {row.provider} has nothing of '{name}' (e.g. an up that failed before it "
                f"created anything), 'cloudtrain down {name} --forget' forgets it here without "
                "asking.")
            raise
        forget_unasked(env, row, exc)


def forget_unasked(env: Env, row: ClusterRow, why: CloudtrainError) -> None:
    """Forget ``row`` here without its provider's word: its ledger interval closes now, its
    running launches are cancelled, its row and folder go. Says what was not checked."""
    name, pname = row.name, row.provider
    nodes = (f" Its last record has {len(row.nodes)} node(s): if they still exist they bill "
             "until removed." if row.nodes else "")
    env.ui.warn(f"'{name}': {pname} cannot be asked ({why.message}); forgetting it here "
                f"without checking (--forget).{nodes} Once {pname} can be asked, 'cloudtrain gc "
                f"--provider {pname}' finds by its tag anything of it that is left.")
    with cluster_lock(env, name):
        env.state.close_usage(name, reason="forgotten")
        for launch in env.state.launches(name):
            if launch.status == "RUNNING":
                env.state.finish_launch(launch.job_id, "CANCELLED", None, None)
        env.state.delete_cluster(name)
        teardown.forget_files(env, name)
    env.ui.ok(f"'{name}' is forgotten here; {pname} was not asked")
