"""Checkpoints: save_state / save_weights_for_sampler paths, loading them back (same weights), TTL, and the
REST routes the SDK's RestClient exposes for listing, inspecting and deleting them."""

from __future__ import annotations

import secrets

from runner.tools.conformance.core import Ctx, Fail, Saved, Skip, check, logprobs_of


def _saved(ctx: Ctx) -> Saved:
    """One training client that took a step, then save_state (with a TTL), save_state, save_weights_for_sampler."""
    with ctx.lock:
        if ctx.saved is None:
            tc = ctx.training_client("checkpoints")
            ids = ctx.tokens("Checkpoints keep the weights", [30, 31, 32, 33, 34])
            datum = ctx.datum(ids, weights=[1.0] * (len(ids) - 1))
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(ctx.types.AdamParams(learning_rate=1e-2))
            tag = secrets.token_hex(3)
            ttl = ctx.wait(tc.save_state(f"conf-ttl-{tag}", ttl_seconds=3600)).path
            plain = ctx.wait(tc.save_state(f"conf-{tag}")).path
            sampler = ctx.wait(tc.save_weights_for_sampler(f"conf-s-{tag}")).path
            lp = logprobs_of(ctx.wait(tc.forward([datum], "cross_entropy")))[0]
            ctx.saved = Saved(tc, ttl, plain, sampler, tag, datum, ids, lp)
        return ctx.saved


@check("checkpoints", "save_paths", timeout_s=120)
def save_paths(ctx: Ctx) -> str:
    s = _saved(ctx)
    run = s.tc.model_id
    want = [(s.ttl, f"tinker://{run}/weights/conf-ttl-{s.tag}"), (s.plain, f"tinker://{run}/weights/conf-{s.tag}"),
            (s.sampler, f"tinker://{run}/sampler_weights/conf-s-{s.tag}")]
    for got, path in want:
        if got != path:
            raise Fail(f"saved checkpoint path {got!r}, expected {path!r}")
    parsed = ctx.types.ParsedCheckpointTinkerPath.from_tinker_path(s.sampler)
    if parsed.training_run_id != run or parsed.checkpoint_type != "sampler":
        raise Fail(f"ParsedCheckpointTinkerPath of {s.sampler} gives {parsed}")
    return "tinker://<run>/{weights,sampler_weights}/<name>"


@check("checkpoints", "load_state", timeout_s=150)
def load_state(ctx: Ctx) -> str:
    s = _saved(ctx)
    for how in ("create_training_client_from_state", "create_training_client_from_state_with_optimizer"):
        tc = ctx.wait(getattr(ctx.service, how)(s.plain), timeout=120)
        lp = logprobs_of(ctx.wait(tc.forward([s.datum], "cross_entropy")))[0]
        if any(not ctx.close_enough(a, b) for a, b in zip(lp, s.lp, strict=True)):
            raise Fail(f"{how}: the loaded weights give logprobs {lp}, the saved run gave {s.lp}")
    return "both loaders give the saved weights"


@check("checkpoints", "sampler_weights", timeout_s=120)
def sampler_weights(ctx: Ctx) -> str:
    s = _saved(ctx)
    sampler = ctx.wait(ctx.service.create_sampling_client(model_path=s.sampler), timeout=90)
    lps = ctx.wait(sampler.compute_logprobs(ctx.types.ModelInput.from_ints(s.ids)))
    got = [x for x in lps[1:] if x is not None]
    if len(got) != len(s.lp):
        raise Fail(f"compute_logprobs over {s.sampler} gave {lps}: expected None, then {len(s.lp)} logprobs")
    worst = max(abs(a - b) for a, b in zip(got, s.lp, strict=True))
    if worst > max(ctx.atol * 10, 2e-2):
        raise Fail(f"a sampler over {s.sampler} disagrees with the trainer: max |dlogprob| {worst:.4f}")
    return f"max |dlogprob| vs trainer {worst:.2e}"


@check("checkpoints", "rest_listing_and_ttl", timeout_s=90)
def rest_listing_and_ttl(ctx: Ctx) -> str:
    s = _saved(ctx)
    run = s.tc.model_id
    listed = {c.tinker_path: c for c in ctx.wait(ctx.rest.list_checkpoints(run)).checkpoints}
    missing = [p for p in (s.ttl, s.plain, s.sampler) if p not in listed]
    if missing:
        raise Fail(f"list_checkpoints({run}) does not list {missing}")
    if listed[s.ttl].expires_at is None:
        raise Fail("a checkpoint saved with ttl_seconds=3600 has no expires_at")
    if listed[s.plain].expires_at is not None:
        raise Fail("a checkpoint saved without ttl_seconds has an expires_at")
    types_ = {listed[s.plain].checkpoint_type, listed[s.sampler].checkpoint_type}
    if types_ != {"training", "sampler"}:
        raise Fail(f"checkpoint_type values {types_}, expected training and sampler")
    user = {c.tinker_path for c in ctx.wait(ctx.rest.list_user_checkpoints()).checkpoints}
    if s.plain not in user:
        raise Fail("list_user_checkpoints does not list the new checkpoint")
    info = ctx.wait(ctx.rest.get_weights_info_by_tinker_path(s.plain))
    if info.lora_rank != 4 or info.base_model != ctx.model:
        raise Fail(f"get_weights_info_by_tinker_path: rank {info.lora_rank}, base {info.base_model!r}")
    if ctx.wait(ctx.rest.get_training_run_by_tinker_path(s.plain)).training_run_id != run:
        raise Fail("get_training_run_by_tinker_path names another run")
    detail = "list_checkpoints, list_user_checkpoints, weights_info, run_by_path, expires_at"
    setter = getattr(ctx.rest, "set_checkpoint_ttl_from_tinker_path", None)
    if setter is not None:
        ctx.wait(setter(s.plain, 7200))
        after = {c.tinker_path: c for c in ctx.wait(ctx.rest.list_checkpoints(run)).checkpoints}
        if after[s.plain].expires_at is None:
            raise Fail("set_checkpoint_ttl_from_tinker_path(7200) left expires_at unset")
        detail += ", set_checkpoint_ttl"
    return detail


@check("checkpoints", "rest_delete", timeout_s=90)
def rest_delete(ctx: Ctx) -> str:
    s = _saved(ctx)
    tc = s.tc
    path = ctx.wait(tc.save_state(f"conf-del-{s.tag}")).path
    ctx.wait(ctx.rest.delete_checkpoint_from_tinker_path(path))
    listed = {c.tinker_path for c in ctx.wait(ctx.rest.list_checkpoints(tc.model_id)).checkpoints}
    if path in listed:
        raise Fail(f"{path} is still listed after delete_checkpoint_from_tinker_path")
    try:
        ctx.wait(ctx.service.create_training_client_from_state(path), timeout=60)
    except TimeoutError:
        raise Fail("loading a deleted checkpoint hangs") from None
    except Exception as exc:  # noqa: BLE001 - any clear refusal will do here; errors.py checks the category
        return f"deleted; loading it fails: {type(exc).__name__}"
    raise Fail(f"loading the deleted checkpoint {path} succeeded")


@check("checkpoints", "overwrite_refused", timeout_s=90)
def overwrite_refused(ctx: Ctx) -> str:
    s = _saved(ctx)
    tc = s.tc
    import inspect

    if "overwrite" not in inspect.signature(tc.save_state).parameters:
        raise Skip("this SDK's save_state has no overwrite flag")
    try:
        ctx.wait(tc.save_state(f"conf-{s.tag}"))
    except TimeoutError:
        raise Fail("saving over an existing checkpoint hangs") from None
    except Exception as exc:  # noqa: BLE001
        ctx.wait(tc.save_state(f"conf-{s.tag}", overwrite=True))
        return f"refused ({type(exc).__name__}); overwrite=True replaces it"
    raise Fail("save_state over an existing name without overwrite=True succeeded")
