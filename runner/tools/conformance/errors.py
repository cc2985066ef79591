"""Errors that must be the user's: the SDK raises a 4xx APIStatusError or a RequestFailedError of category
User within the timeout; a hang, a 5xx (which the SDK retries for minutes) or a server-category error fails."""

from __future__ import annotations

from collections.abc import Callable

from runner.tools.conformance.core import Ctx, Fail, check

RETRIED = (408, 409, 429)


def user_error(ctx: Ctx, what: str, call: Callable[[], object]) -> str:
    t = ctx.tinker
    try:
        call()
    except TimeoutError:
        raise Fail(f"{what}: no answer within the timeout") from None
    except t.APIStatusError as exc:
        if 400 <= exc.status_code < 500 and exc.status_code not in RETRIED:
            return f"HTTP {exc.status_code}"
        raise Fail(f"{what}: HTTP {exc.status_code} ({str(exc)[:120]}); a user error is a 4xx") from None
    except t.RequestFailedError as exc:
        if str(exc.category).lower().endswith("user"):
            return f"RequestFailedError(user): {exc.message[:60]}"
        raise Fail(f"{what}: RequestFailedError category {exc.category} ({exc.message[:120]}); expected user") from None
    except (ValueError, TypeError) as exc:  # refused by the SDK before sending: the user's error all the same
        return f"refused client-side: {type(exc).__name__}"
    raise Fail(f"{what}: accepted (expected a user error)")


@check("errors", "error/unknown_model", timeout_s=60)
def unknown_model(ctx: Ctx) -> str:
    return user_error(ctx, "create_lora_training_client('no-such-org/no-such-model')", lambda: ctx.wait(
        ctx.service.create_lora_training_client("no-such-org/no-such-model", rank=4), timeout=45))


@check("errors", "error/unknown_loss", timeout_s=60)
def unknown_loss(ctx: Ctx) -> str:
    tc = ctx.training_client("errors")
    d = ctx.datum([1, 2, 3, 4], weights=[1.0, 1.0, 1.0])
    return user_error(ctx, "forward_backward(loss_fn='no_such_loss')",
                      lambda: ctx.wait(tc.forward_backward([d], "no_such_loss")))  # type: ignore[arg-type]


@check("errors", "error/missing_loss_input", timeout_s=60)
def missing_loss_input(ctx: Ctx) -> str:
    tc = ctx.training_client("errors")
    d = ctx.datum([1, 2, 3, 4], weights=[1.0, 1.0, 1.0])  # importance_sampling needs logprobs and advantages
    return user_error(ctx, "importance_sampling without advantages",
                      lambda: ctx.wait(tc.forward_backward([d], "importance_sampling")))


@check("errors", "error/token_out_of_range_train", timeout_s=60)
def token_out_of_range_train(ctx: Ctx) -> str:
    tc = ctx.training_client("errors")
    d = ctx.datum([1, 2, 10**9, 3], weights=[1.0, 1.0, 1.0])
    return user_error(ctx, "forward_backward with token id 1e9", lambda: ctx.wait(tc.forward_backward([d], "cross_entropy")))


@check("errors", "error/token_out_of_range_sample", timeout_s=90)
def token_out_of_range_sample(ctx: Ctx) -> str:
    sampler = ctx.wait(ctx.service.create_sampling_client(base_model=ctx.model), timeout=60)
    prompt = ctx.types.ModelInput.from_ints([1, 2, 10**9])
    return user_error(ctx, "sample with prompt token id 1e9", lambda: ctx.wait(
        sampler.sample(prompt, 1, ctx.types.SamplingParams(max_tokens=2))))


@check("errors", "error/bad_sampling_params", timeout_s=90)
def bad_sampling_params(ctx: Ctx) -> str:
    sampler = ctx.wait(ctx.service.create_sampling_client(base_model=ctx.model), timeout=60)
    prompt = ctx.types.ModelInput.from_ints([1, 2, 3])
    out = []
    sp = ctx.types.SamplingParams
    for label, params in (("temperature=-1", lambda: sp(temperature=-1.0, max_tokens=2)),
                          ("max_tokens=-1", lambda: sp(max_tokens=-1)),
                          ("top_p=2", lambda: sp(top_p=2.0, max_tokens=2))):
        out.append(label + ": " + user_error(ctx, f"sample with {label}", lambda params=params: ctx.wait(
            sampler.sample(prompt, 1, params()))))
    return "; ".join(out)


@check("errors", "error/bad_lora_rank", timeout_s=60)
def bad_lora_rank(ctx: Ctx) -> str:
    return user_error(ctx, "create_lora_training_client(rank=0)", lambda: ctx.wait(
        ctx.service.create_lora_training_client(ctx.model, rank=0), timeout=45))


@check("errors", "error/bad_learning_rate", timeout_s=60)
def bad_learning_rate(ctx: Ctx) -> str:
    tc = ctx.training_client("errors")
    return user_error(ctx, "optim_step(learning_rate=-1)", lambda: ctx.wait(
        tc.optim_step(ctx.types.AdamParams(learning_rate=-1.0))))


@check("errors", "error/unknown_checkpoint", timeout_s=60)
def unknown_checkpoint(ctx: Ctx) -> str:
    tc = ctx.training_client("errors")
    path = f"tinker://{tc.model_id}/weights/never-saved"
    return user_error(ctx, f"create_training_client_from_state({path})", lambda: ctx.wait(
        ctx.service.create_training_client_from_state(path), timeout=45))


@check("errors", "error/shape_mismatch", timeout_s=60)
def shape_mismatch(ctx: Ctx) -> str:
    tc = ctx.training_client("errors")
    d = ctx.datum([1, 2, 3, 4], weights=[1.0, 1.0])  # 3 targets, 2 weights
    return user_error(ctx, "forward_backward with 3 targets and 2 weights",
                      lambda: ctx.wait(tc.forward_backward([d], "cross_entropy")))
