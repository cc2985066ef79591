"""The recipe schema: every table a recipe file may hold, its defaults, limits and choices.

A recipe file holds named recipes under `[recipes.<name>]`; `FILE#name` selects one. Each table is decoded
with msgspec into `Recipe` (unknown keys forbidden, tagged unions with `kind` for every choice, limits in
the types). This module is only the schema: reading files, overrides and `runner show` are runner/recipe/load.py,
turning msgspec's errors into one line is runner/recipe/explain.py, importing `pkg.mod:fn` targets runner/recipe/targets.py.
The tables an extension kind adds are declared beside its code, each in a `*_config.py` (docs/extending.md), and this
module builds the unions from them (backends/configs.py `found`): `algo` from runner/algos/NAME_config.py, `backend`
from backends/NAME/NAME_config.py (a user's: runner/recipe/python_backend.py); `algo.env` and `evals` are the unions of
runner/recipe/envs.py and runner/recipe/pinned.py, `algo.loss` runner/algos/rl_config.py's.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal, Union

import msgspec
from msgspec import Meta

from backends.backend_config import BackendConfig, builtin_configs, default_backend
from backends.configs import found, variants
from runner.algos.rl_config import RL, Async
from runner.engine.inspect_eval_config import InspectPinned as InspectPinned  # runner/recipe/load.py's import
from runner.recipe.common import (
    TARGET_PATTERN,
    AlgoBase,
    Base,
    DataSource,
    Frac,
    Json,
    NonNegInt,
    PosFloat,
    PosInt,
    RecipeRef,
)
from runner.recipe.cost import Budget, Price
from runner.recipe.envs import Env
from runner.recipe.pinned import PinnedEval
from runner.recipe.python_backend import PythonBackend as PythonBackend  # a variant of Backend, so imported
from runner.recipe.sources import File as File  # runner/recipe/load.py's import
from runner.recipe.sources import Jsonl as Jsonl  # runner/recipe/load.py's import

# The backend variants: every BackendConfig subclass, declared by the backends themselves (found by their file,
# backends/NAME/NAME_config.py, in name order: local first, the default) and a user's (`kind = "python"`).
BUILTIN_BACKENDS = builtin_configs()
BACKEND_VARIANTS: tuple[type[BackendConfig], ...] = (
    *BUILTIN_BACKENDS, *(v for v in variants(BackendConfig) if v not in BUILTIN_BACKENDS))
if TYPE_CHECKING:
    Backend = BackendConfig
else:
    Backend = Union[BACKEND_VARIANTS]  # noqa: UP007 - built from the variants at import

# ---------------------------------------------------------------- model, LoRA, optimizer, schedule

class LoRA(Base):
    rank: PosInt = 32
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")


class Optim(Base):
    """AdamW. Defaults are Tinker's (eps 1e-12; the cookbook uses 1e-8)."""

    beta1: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Meta(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Meta(ge=0)] = 1e-12
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    # Global-norm clip; 0 = off.
    grad_clip_norm: Annotated[float, Meta(ge=0)] = 0.0


class ScheduleBase(Base, tag_field="kind", tag=str.lower):
    # Linear ramp from 0 to lr over the first warmup_steps steps.
    warmup_steps: NonNegInt = 0


class Constant(ScheduleBase):
    pass


class Linear(ScheduleBase):
    """Decays linearly to final_frac·lr at the last step (the cookbook's default, with final_frac 0)."""

    final_frac: Frac = 0.0


class Cosine(ScheduleBase):
    final_frac: Frac = 0.0


Schedule = Constant | Linear | Cosine




# ---------------------------------------------------------------- algorithms

# Every algorithm: the structs of runner/algos/NAME_config.py (each implemented by runner/algos/NAME.py), in file-name
# order; a user's is `kind = "python"` (runner/algos/python_config.py).
ALGO_VARIANTS: tuple[type[AlgoBase], ...] = found(AlgoBase, "runner.algos")
if TYPE_CHECKING:
    Algo = AlgoBase
else:
    Algo = Union[ALGO_VARIANTS]  # noqa: UP007 - built from the variants at import


# ---------------------------------------------------------------- renderers


class PythonRenderer(Base, tag_field="kind", tag="python"):
    """A user's renderer: `renderer = {kind = "python", target = "pkg.mod:NAME"}`, NAME a Renderer subclass or a
    factory tokenizer -> Renderer. The old short spelling `renderer = "pkg.mod:NAME"` is refused in a recipe
    (runner/recipe/load.py refuse_short_renderer); the decoded Recipe holds the target string."""

    target: Annotated[str, Meta(pattern=TARGET_PATTERN, description="'pkg.mod:NAME'")]


if TYPE_CHECKING:
    RendererName = str
else:
    RendererName = str | PythonRenderer  # decoded, then kept as its target string (Recipe.__post_init__)


# ---------------------------------------------------------------- experiment tracking


class WandB(Base):
    """Weights & Biases: every metrics.jsonl row is logged (x axis `step`), the resolved recipe is the run's config,
    and a resumed run continues the same W&B run (its id is kept in the run dir's wandb.json). Needs the `wandb`
    package; the API key comes from the environment (WANDB_API_KEY or `wandb login`), never from the recipe;
    WANDB_MODE=offline logs locally (`wandb sync` later)."""

    project: str
    entity: str | None = None
    # Default: the run dir's path under runs/ (sl_basic, or sl_basic/lr=0.001 for a sweep point).
    name: str | None = None
    # Default for sweep points: the sweep's name, so W&B groups them.
    group: str | None = None
    tags: list[str] = msgspec.field(default_factory=list)


class TensorBoard(Base):
    """TensorBoard event files (`tensorboard --logdir runs`): every metrics.jsonl row as scalars at its `step`, the
    resolved recipe as the run's hparams (flattened: `lora.rank`); a resumed session writes a new event file that
    starts by purging the steps it logs again. Needs the `tensorboardX` package (the `tensorboard` extra)."""

    # Default: the run dir itself, so TensorBoard names each run by its dir (a sweep's points: sweep/point). Set: the
    # event files go to <dir>/<name>, so `tensorboard --logdir <dir>` shows every run that logs there.
    dir: str | None = None
    # The run's folder under `dir` (default: the run dir's path under runs/: sl_basic, or sl_basic/lr=0.001 for a
    # sweep point); not used without `dir`.
    name: str | None = None


class MLflow(Base):
    """MLflow: every metrics.jsonl row as metrics at its `step`, the resolved recipe as the run's params (flattened:
    `lora.rank`), the run's status at the end (FINISHED, KILLED when interrupted, FAILED); a resumed run continues
    the same MLflow run (its id is kept in the run dir's mlflow.json). Needs the `mlflow` package (the `mlflow`
    extra); credentials come from the environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD /
    MLFLOW_TRACKING_TOKEN), never from the recipe."""

    # Default: MLFLOW_EXPERIMENT_NAME, else MLflow's "Default" experiment.
    experiment: str | None = None
    # Default: MLFLOW_TRACKING_URI, else MLflow's own default (sqlite:///mlflow.db in the working directory).
    tracking_uri: str | None = None
    # Default: the run dir's path under runs/ (sl_basic, or sl_basic/lr=0.001 for a sweep point).
    name: str | None = None
    # Default for sweep points: the sweep's name; the points are nested under a parent run of that name.
    group: str | None = None

    def __post_init__(self) -> None:
        if self.tracking_uri is not None and re.match(r"^[a-z][a-z0-9+.-]*://[^/@]*@", self.tracking_uri, re.I):
            raise ValueError("tracking_uri must not hold credentials: set MLFLOW_TRACKING_USERNAME and "
                             "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment instead")


class Trackio(Base):
    """Trackio (Hugging Face's local-first tracker, `trackio show`): every metrics.jsonl row at its `step`, the
    resolved recipe as the run's config (flattened: `lora.rank`); a resumed run continues the same Trackio run (kept
    in the run dir's trackio.json). Needs the `trackio` package (the `trackio` extra); a Space or server and its
    token come from trackio's own environment variables (TRACKIO_SPACE_ID, HF_TOKEN), never from the recipe."""

    project: str
    # Default: the run dir's path under runs/ (sl_basic, or sl_basic/lr=0.001 for a sweep point).
    name: str | None = None
    # Default for sweep points: the sweep's name, so Trackio groups them.
    group: str | None = None


class Log(Base):
    # Where metrics go besides metrics.jsonl (default: nowhere), any several at once (docs/tracking.md). Changing
    # this table never stops a resume.
    wandb: WandB | None = None
    tensorboard: TensorBoard | None = None
    mlflow: MLflow | None = None
    trackio: Trackio | None = None


# ---------------------------------------------------------------- smoke stand-ins (runner/tools/smoke.py)


class Smoke(Base):
    """What `runner run FILE#name --smoke` and `runner smoke FILE` use in place of what needs the network or time."""

    # Stand-in data by the key path of each data source in the recipe, e.g. {"algo.data" = {kind = "jsonl", path =
    # "examples/data/chat_sft.jsonl"}} or "algo.datasets[1].prompts". Default: the recipe's own data when it is local.
    data: dict[str, DataSource] = {}
    # Stand-in RL environment (replaces algo.env).
    env: Env | None = None
    # Stand-in base model ("tiny" or a local folder). Default: a small random-init model of the recipe model's
    # family when its config and tokenizer are local (a folder or the Hugging Face cache), else "tiny".
    model: str | None = None
    # Steps of each smoked stage.
    steps: Annotated[int, Meta(ge=1, le=100)] = 2
    # Any other key, as on the command line: {"algo.max_tokens" = 8}; applied last.
    overrides: Json = {}




# ---------------------------------------------------------------- the recipe


class Recipe(Base):
    # ---- Core
    algo: Algo
    # Base model. Local: "tiny" (the embedded default), a Hugging Face model folder, or a cached hub id.
    # Tinker: the service's model name, e.g. "Qwen/Qwen3-8B".
    model: str = "tiny"
    # Tokenizer folder or name when it differs from the model's (e.g. offline use of a Tinker model).
    tokenizer: str | None = None
    # How conversations become tokens, for every algorithm (docs/renderers.md): "auto" = the cookbook's renderer
    # for the model name, else the tokenizer's chat template ("hf"), else "role_colon" (a base model); or a
    # renderer by name ("llama3", "qwen3", "qwen3_disable_thinking", "deepseekv3", "gpt_oss_no_sysprompt", ...).
    # Your own: {kind = "python", target = "pkg.mod:NAME"}, held as "pkg.mod:NAME" once decoded.
    renderer: RendererName = "auto"
    backend: Backend = default_backend()  # the local backend (backends/backend_config.py DEFAULT_KIND)
    # At most 2**63 - 1: torch seeds are signed 64-bit (a larger one failed at the first client, after check).
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    # Peak learning rate, or "auto": the cookbook's get_lr(model) for LoRA, resolved when the recipe loads
    # (runner/recipe/lr.py; `runner show` says so).
    lr: PosFloat = 1e-4
    # Cap on optimizer steps (default: every batch of every epoch).
    max_steps: PosInt | None = None
    # Run directory; default runs/<recipe name>.
    log_dir: str | None = None
    # Start from another run's final weights (fresh optimizer, step 0): "FILE#name", "#name" (a recipe in this
    # file) or a run dir. `runner run` runs an unfinished upstream recipe first (resuming it if partial), chains
    # of any depth. The upstream must train the same model and adapter shape (runner/engine/chain.py).
    init_from: RecipeRef | None = None

    # ---- Advanced
    lora: LoRA = LoRA()
    optim: Optim = Optim()
    schedule: Schedule = Linear()
    # Steps submitted ahead of the one being finished; 0 = fully synchronous.
    depth: Annotated[int, Meta(ge=0, le=64)] = 1
    # Steps between evals / checkpoints; 0 = never (a final checkpoint is always written). Evals run before
    # steps 0, N, 2N, ...; every algorithm also evaluates the final weights once after the last step (logged at
    # step = the number of steps, as the cookbook's RL does) when eval_every > 0 and there is a test set.
    eval_every: NonNegInt = 10
    save_every: NonNegInt = 20
    # An existing run dir: resume it (only if it holds this same recipe), move it aside, or stop.
    if_exists: Literal["resume", "overwrite", "error"] = "resume"
    # Experiment tracking (e.g. log = {wandb = {project = "my-project"}}, tensorboard, mlflow, trackio); off by default.
    log: Log = Log()
    # Stand-ins for `--smoke` (offline, seconds): data, env, model, steps. Not used by a real run.
    smoke: Smoke | None = None
    # Evals pinned in the recipe ([[recipes.x.evals]]: kind = "math" | "nll" | "python" | "inspect"), see
    # runner/engine/evals.py.
    evals: list[PinnedEval] = []
    # Cost (runner/recipe/cost.py, docs/cost.md): USD per million tokens for this model (over the shipped table and
    # price_file / $RUNNER_PRICES), and a budget = {usd = ..., tokens = ...} that stops the run at a checkpoint.
    price: Price | None = None
    price_file: str | None = None
    budget: Budget | None = None

    def __post_init__(self) -> None:
        from runner.renderers.registry import did_you_mean
        from runner.renderers.registry import names as renderer_names

        if isinstance(self.renderer, PythonRenderer):  # the one spelling of user code, held as its target
            msgspec.structs.force_setattr(self, "renderer", self.renderer.target)

        if self.renderer not in renderer_names() and re.fullmatch(TARGET_PATTERN, self.renderer) is None:
            raise ValueError(f"renderer {self.renderer!r} is unknown{did_you_mean(self.renderer)}; choose one of: "
                             f"{', '.join(renderer_names())}, or your own as "
                             "{kind = \"python\", target = \"pkg.mod:NAME\"}")
        if isinstance(self.algo, RL) and isinstance(self.algo.mode, Async) and self.depth == 0:
            raise ValueError("algo.mode async samples while the previous step trains: it needs depth >= 1")
