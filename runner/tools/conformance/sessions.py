"""Sessions and capabilities: get_server_capabilities, creating a training client, get_info, the tokenizer,
the training run as the REST client sees it."""

from __future__ import annotations

from backends.tokenizer import decode_text
from runner.tools.conformance.core import Ctx, Fail, check


@check("sessions", "capabilities", timeout_s=60)
def capabilities(ctx: Ctx) -> str:
    caps = ctx.capabilities()
    names = [m.model_name for m in caps.supported_models]
    if not names:
        raise Fail("get_server_capabilities lists no supported models")
    if ctx.requested_model and ctx.requested_model not in names:
        raise Fail(f"--model {ctx.requested_model} is not among the supported models {names}")
    return f"models: {', '.join(map(str, names))}"


@check("sessions", "create_training_client", timeout_s=150)
def create_training_client(ctx: Ctx) -> str:
    tc = ctx.training_client("main")
    info = tc.get_info()
    if info.model_id != tc.model_id:
        raise Fail(f"get_info().model_id {info.model_id!r} != the client's model_id {tc.model_id!r}")
    if info.model_data.model_name != ctx.model:
        raise Fail(f"get_info().model_data.model_name {info.model_data.model_name!r} != {ctx.model!r}")
    if getattr(info, "lora_rank", 4) not in (4, None):
        raise Fail(f"get_info().lora_rank is {info.lora_rank}, created with rank 4")
    return f"model_id {tc.model_id}"


@check("sessions", "tokenizer", timeout_s=120)
def tokenizer(ctx: Ctx) -> str:
    tok = ctx.tokenizer()
    if tok is None:
        raise Fail(f"get_tokenizer() failed: {ctx._tokenizer_error}")
    ids = tok.encode("Hello world", add_special_tokens=False)
    if not ids or decode_text(tok, ids).strip() != "Hello world":
        raise Fail(f"encode/decode does not round-trip 'Hello world' (ids {ids})")
    return f"{type(tok).__name__}, vocab {len(tok)}"


@check("sessions", "training_run_rest", timeout_s=60)
def training_run_rest(ctx: Ctx) -> str:
    tc = ctx.training_client("main")
    run = ctx.wait(ctx.rest.get_training_run(tc.model_id))
    if run.training_run_id != tc.model_id:
        raise Fail(f"get_training_run returned run {run.training_run_id!r}, asked for {tc.model_id!r}")
    if run.base_model != ctx.model or run.lora_rank != 4:
        raise Fail(f"get_training_run says base_model={run.base_model!r} lora_rank={run.lora_rank}; "
                   f"created {ctx.model!r} rank 4")
    listed = ctx.wait(ctx.rest.list_training_runs())
    if tc.model_id not in [r.training_run_id for r in listed.training_runs]:
        raise Fail("list_training_runs does not list the new run")
    return "get_training_run, list_training_runs"


@check("sessions", "sampling_client_base_model", timeout_s=90)
def sampling_client_base_model(ctx: Ctx) -> str:
    sc = ctx.wait(ctx.service.create_sampling_client(base_model=ctx.model), timeout=90)
    if sc.get_base_model() != ctx.model:
        raise Fail(f"the sampling client's base model is {sc.get_base_model()!r}, asked for {ctx.model!r}")
    lps = ctx.wait(sc.compute_logprobs(ctx.types.ModelInput.from_ints(ctx.tokens("one two three", [1, 2, 3]))))
    if not lps or lps[0] is not None or any(x is None or x > 1e-4 for x in lps[1:]):
        raise Fail(f"compute_logprobs should be [None, negative floats...], got {lps}")
    return f"{len(lps)} logprobs"


@check("sessions", "second_session_close", timeout_s=120)
def second_session_close(ctx: Ctx) -> str:
    """A second ServiceClient gets its own session and run ids; close() returns, and the first session goes on."""
    other = ctx.tinker.ServiceClient(base_url=ctx.base_url, api_key=ctx.api_key)
    try:
        tc = ctx.wait(other.create_lora_training_client(ctx.model, rank=4, seed=0), timeout=90)
        if tc.model_id == ctx.training_client("main").model_id:
            raise Fail(f"two sessions were given the same model_id {tc.model_id}")
    finally:
        closing = getattr(other, "close", None)
        if callable(closing):
            ctx.wait(closing("success"), timeout=30)
    ids = ctx.tokens("still here", [1, 2, 3])
    ctx.wait(ctx.training_client("main").forward([ctx.datum(ids, weights=[1.0] * (len(ids) - 1))], "cross_entropy"))
    return "separate model ids; close() returned"
