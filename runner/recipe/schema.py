"""The recipe schema: every table a recipe file may hold, its defaults, limits and choices.

A recipe file holds named recipes under `[recipes.<name>]`; `FILE#name` selects one. Each table is decoded
with msgspec into `Recipe` (unknown keys forbidden, tagged unions with `kind` for every choice, limits in
the types). This module is only the schema: reading files, overrides and `runner show` are runner/recipe/load.py,
turning msgspec's errors into one line is runner/recipe/explain.py, importing `pkg.mod:fn` targets runner/recipe/targets.py.
The backend tables (`backend = {kind = ...}`) are declared by each backend (backends/NAME/NAME_config.py), a user's
own by runner/recipe/python_backend.py.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

from backends import losses
from backends.backend_config import BackendConfig, builtin_configs
from backends.local.local_config import Local

# The schema's parts, re-exported: every recipe type is importable from here.
from runner.recipe.common import TARGET_PATTERN as TARGET_PATTERN
from runner.recipe.common import Base as Base
from runner.recipe.common import DataSource as DataSource
from runner.recipe.common import Frac as Frac
from runner.recipe.common import NonNegFloat as NonNegFloat
from runner.recipe.common import NonNegInt as NonNegInt
from runner.recipe.common import PosFloat as PosFloat
from runner.recipe.common import PosInt as PosInt
from runner.recipe.common import Python as Python
from runner.recipe.common import RecipeRef as RecipeRef
from runner.recipe.common import RunOutput as RunOutput
from runner.recipe.common import Target as Target
from runner.recipe.common import TrainOnWhat as TrainOnWhat
from runner.recipe.common import variants
from runner.recipe.cost import Budget, Price
from runner.recipe.envs import BUILTIN_TOOLS as BUILTIN_TOOLS
from runner.recipe.envs import Arithmetic as Arithmetic
from runner.recipe.envs import Code as Code
from runner.recipe.envs import Env as Env
from runner.recipe.envs import EnvBase as EnvBase
from runner.recipe.envs import GuessNumber as GuessNumber
from runner.recipe.envs import JudgeModel as JudgeModel
from runner.recipe.envs import Math as Math
from runner.recipe.envs import ModelJudge as ModelJudge
from runner.recipe.envs import Preference as Preference
from runner.recipe.envs import PythonEnv as PythonEnv
from runner.recipe.envs import PythonGrader as PythonGrader
from runner.recipe.envs import ReasoningGym as ReasoningGym
from runner.recipe.envs import Rubric as Rubric
from runner.recipe.envs import TicTacToe as TicTacToe
from runner.recipe.envs import ToolUse as ToolUse
from runner.recipe.envs import TwentyQuestions as TwentyQuestions
from runner.recipe.envs import Verifiers as Verifiers
from runner.recipe.numerics_table import Numerics, check_temperature
from runner.recipe.pinned import InspectPinned as InspectPinned
from runner.recipe.pinned import MathPinned as MathPinned
from runner.recipe.pinned import NLLPinned as NLLPinned
from runner.recipe.pinned import PinnedEval as PinnedEval
from runner.recipe.pinned import PinnedEvalBase as PinnedEvalBase
from runner.recipe.pinned import PythonPinned as PythonPinned
from runner.recipe.python_backend import PythonBackend as PythonBackend
from runner.recipe.sources import HF as HF  # the file/hub data sources, re-exported
from runner.recipe.sources import DataBase as DataBase
from runner.recipe.sources import File as File
from runner.recipe.sources import Jsonl as Jsonl
from runner.recipe.sources import Mapped as Mapped

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

class AlgoBase(Base, tag_field="kind", tag=str.lower):
    # The module that implements the variant: it declares `SPEC = AlgoSpec(...)` (runner/engine/spec.py).
    implementation: ClassVar[str] = ""




class SFT(AlgoBase):
    """Supervised fine-tuning on conversations: {"messages": [{"role", "content"}, ...]} per row."""

    implementation: ClassVar[str] = "runner.algos.sft"

    data: DataSource
    # Conversations per step.
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Truncate rendered conversations (tokens) from the right. Always set (TOML has no null): use a large
    # value to keep whole conversations, at most the model's context (runner/models.toml; `runner check`).
    max_length: PosInt = 1024
    # Which tokens carry loss (the cookbook's TrainOnWhat): "last_assistant_turn" = the assistant messages after
    # the last user one; "all_messages" = every message's content, not its role header ("hf": every token);
    # "all_tokens" = everything; "customized" = the messages with "trainable": true.
    train_on_what: TrainOnWhat = "all_assistant_messages"
    # "mean": each conversation's token weights sum to 1 (the cookbook's default); "none": 1 per token.
    reduction: Literal["mean", "none"] = "mean"
    # Rows held out (after the seeded shuffle) for the eval NLL; 0 = no eval.
    test_size: NonNegInt = 0
    # After the last step, the final weights answer each held-out conversation's last user turn (greedy) and
    # test/agreement is the share of answers equal to the data's (prompt distillation: the student answers like
    # the prompted teacher). Needs test_size > 0.
    agreement: bool = False


class DPO(AlgoBase):
    """Direct preference optimisation on comparisons (runner/data/comparisons.py has the row formats): per pair,
    loss = −log σ(β·((π_c − ref_c) − (π_r − ref_r))), sequence logprobs summed over the completion's tokens; the
    reference is the run's initial weights (the base model), also after a resume."""

    implementation: ClassVar[str] = "runner.algos.dpo"

    data: DataSource
    # Pairs per step (each is two datums: chosen and rejected).
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Truncate each rendered prompt + completion (tokens) from the right.
    max_length: PosInt = 1024
    # Strength of the implicit KL to the reference: small β lets the policy move further (cookbook default 0.1).
    beta: PosFloat = 0.1
    # Pairs held out (after the seeded shuffle) for test/dpo_loss, test/accuracy, test/margin; 0 = no eval.
    test_size: NonNegInt = 0


class RewardModel(AlgoBase, tag="reward_model"):
    """A pairwise judge (the cookbook's RLHF stage 2): SFT on "which completion is better, A or B?" with the
    preferred label as the one trained token, every comparison in both orders (A/B swapped) so position carries
    no signal. runner/rewards/judge.py turns the trained weights into P(a better)."""

    implementation: ClassVar[str] = "runner.algos.reward_model"

    data: DataSource
    # Comparisons per step (each is two datums: both orders).
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Longest judge prompt (tokens); a comparison that renders longer is an error naming its row.
    max_length: PosInt = 2048
    # Comparisons held out for test/accuracy and test/nll; 0 = no eval.
    test_size: NonNegInt = 0




# ---------------------------------------------------------------- RL: losses (the registry: backends/losses.py)


class LossBase(Base, tag_field="kind", tag=str.lower):
    pass


def _loss_variant(spec: losses.LossSpec) -> type[LossBase]:
    """The recipe table of a registered loss: `{kind = NAME, <its fields>}`, checked as the registry checks it."""
    fields = [(f.recipe, Annotated[float, Meta(**f.constraints())], f.default) for f in spec.fields]

    def __post_init__(self: Any) -> None:
        if problem := spec.problem({f.key: getattr(self, f.recipe) for f in spec.fields}):
            raise ValueError(problem)

    namespace = {"__doc__": spec.doc, "__post_init__": __post_init__, "loss_spec": spec}
    title = spec.title or spec.name.title().replace("_", "")
    variant = msgspec.defstruct(title, fields, bases=(LossBase,), tag=spec.name, module=__name__, namespace=namespace)
    assert issubclass(variant, LossBase)
    return variant


# One variant per built-in RL loss, in registry order; a user's loss is PythonLoss.
LOSS_VARIANTS: dict[str, type[LossBase]] = {s.name: _loss_variant(s) for s in losses.BUILTINS if s.in_rl}
ImportanceSampling, PPO, CISPO, DRO = (LOSS_VARIANTS[k] for k in ("importance_sampling", "ppo", "cispo", "dro"))


class PythonLoss(LossBase, tag="python"):
    """Your own loss: `target = "pkg.mod:NAME"` names a backends.losses.LossSpec in your module (registered when the
    run starts; the local backend computes it, Tinker runs it as a custom loss); `args` are its loss_fn_config keys,
    checked against the spec by `runner check`."""

    target: Target
    args: dict[str, float] = {}


if TYPE_CHECKING:
    Loss = LossBase
else:
    Loss = Union[(*LOSS_VARIANTS.values(), PythonLoss)]  # noqa: UP007 - built from the registry at import


# ---------------------------------------------------------------- RL: KL penalty


class KLBase(Base, tag_field="kind", tag=str.lower):
    pass


class NoKL(KLBase, tag="none"):
    pass


class ReferenceKL(KLBase, tag="reference"):
    """adv_t += coef·(mean KL − KL_t) on action tokens, KL_t = lp_sampler − lp_reference; the reference is the
    initial weights (cookbook §1.3, centred on the batch mean)."""

    coef: PosFloat


KL = NoKL | ReferenceKL


# ---------------------------------------------------------------- RL: sampling / training overlap


class ModeBase(Base, tag_field="kind", tag=str.lower):
    pass


class Sync(ModeBase):
    """Each step samples its whole batch from the weights after the previous step, then trains: on-policy."""


class Stream(ModeBase):
    """As sync, but a minibatch's forward_backward is submitted as soon as its groups finish sampling, so
    training overlaps the slowest rollouts; one optim_step per substep."""

    minibatches: PosInt = 2


class Async(ModeBase):
    """Off-policy: step k samples from the newest weights already available (at least those after step
    k − max_staleness), so sampling for step k+1 runs while step k trains. Needs depth >= 1."""

    max_staleness: PosInt = 1
    # Step k always samples the weights after step k − max_staleness (the first steps of a session: the
    # weights it started from), never fresher ones that happen to be ready: which weights a step sees no
    # longer depends on timing, so a seeded run on the local backend's CPU repeats exactly.
    fixed_staleness: bool = False


Mode = Sync | Stream | Async


# ---------------------------------------------------------------- RL: the algorithm


class RLEval(Base):
    # Envs per test group (1 is enough for a mean reward; more gives pass@k-style spread).
    group_size: PosInt = 1
    # Cap on test groups per eval (None: the whole test split).
    max_groups: PosInt | None = None
    # The cookbook's test evaluator samples at 1.0.
    temperature: PosFloat = 1.0


class OnPolicy(AlgoBase):
    """What RL and on-policy distillation share: the policy samples groups (max_tokens, temperature), a built-in
    ratio loss trains on them in any mode, transcripts, evals and the numerics gate; and their checks."""

    ABSTRACT: ClassVar[bool] = True  # not a variant itself (variants(), runner/recipe/common.py)

    # ---- Core
    # Sampled tokens per turn.
    max_tokens: PosInt = 64
    temperature: PosFloat = 1.0
    loss: Loss = ImportanceSampling()
    # ---- Advanced
    mode: Mode = Sync()
    # optim_steps per batch (contiguous chunks of the batch; later chunks train slightly off-policy).
    num_substeps: PosInt = 1
    # Passes over the training split.
    epochs: PosInt = 1
    # Groups written to each iteration_NNNNNN/train.html (and test.html); 0 = no transcripts.
    groups_to_log: NonNegInt = 4
    # Steps between transcripts (iteration_NNNNNN/train.html + train_rollout_summaries.jsonl): steps 0, N, 2N, ...
    # and always the last step; evals (periodic and final) always write test.html. 0 = no transcripts at all.
    transcript_every: NonNegInt = 10
    # After each step, the new weights' logprobs of the batch: optim/kl_pre_post_v1/v2 (one more forward).
    compute_post_kl: bool = False
    eval: RLEval = RLEval()
    # The sampler-vs-trainer logprob gate (runner/recipe/numerics_table.py); None: the numerics/* metrics only.
    numerics: Numerics | None = None

    @property
    def batch_groups(self) -> int:
        """Groups per step (RL: groups_per_batch; distillation: the sum over its prompt sets)."""
        return getattr(self, "groups_per_batch")  # noqa: B009 - a field of RL, a property of Distill

    def __post_init__(self) -> None:
        check_temperature(self.numerics, self.temperature)
        if self.num_substeps > self.batch_groups:
            raise ValueError("num_substeps must be <= groups_per_batch")
        if isinstance(self.mode, Stream):
            per_substep, rem = divmod(self.batch_groups, self.num_substeps)
            if rem or per_substep % self.mode.minibatches:
                raise ValueError("stream mode: groups_per_batch must split evenly into num_substeps × minibatches")


class RL(OnPolicy, kw_only=True):
    """Group-relative policy gradient on environments (cookbook rl/train.py): per group, advantage = reward −
    group mean; datums carry sampler logprobs and per-token advantages; a built-in ratio loss."""

    implementation: ClassVar[str] = "runner.algos.rl"

    # ---- Core (and OnPolicy's)
    env: Env
    # Episodes per group (the baseline is their mean reward; 1 would make every advantage 0).
    group_size: Annotated[int, Meta(ge=2)] = 4
    groups_per_batch: PosInt = 16
    # ---- Advanced (and OnPolicy's)
    kl: KL = NoKL()
    # Drop groups whose rewards are all equal (they carry no signal, only KL/entropy drift).
    remove_constant_reward_groups: bool = False
    # Divide advantages by the group's reward std (off, as in the cookbook: the std couples reward scale and step size).
    normalize_std: bool = False
    # Seconds a group's rollout (its envs' steps and their sampling) may take; past it the group is cancelled,
    # dropped and counted (rollout_errors/EnvTimeout). None: no limit.
    env_timeout_s: PosFloat | None = None

    def __post_init__(self) -> None:
        if isinstance(self.env, TicTacToe) and self.env.opponent == "self" and self.group_size % 2:
            raise ValueError("tictactoe self-play needs an even group_size (two seats per game)")
        super().__post_init__()


# ---------------------------------------------------------------- on-policy distillation


class Teacher(Base):
    """Whose logprobs the student learns from: a chained run's final weights (init_from), a saved sampler checkpoint
    (a local adapter folder or a tinker:// path), or else the base model `model` (default: the recipe's model)."""

    init_from: RecipeRef | None = None
    checkpoint: str | None = None
    # The teacher's base model. It must share the student's tokenizer (checked by `runner check`).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.init_from is not None and self.checkpoint is not None:
            raise ValueError("give init_from or checkpoint, not both")


class DistillSet(Base):
    """A prompt set and its teacher (several sets = the cookbook's multi-teacher distillation)."""

    # Rows {"messages": [...]}: the conversation the student continues (its last message is the user's).
    prompts: DataSource
    teacher: Teacher = Teacher()
    # Groups of this set per step.
    groups_per_batch: PosInt = 8
    # Prompts held out for evals (test/teacher_kl).
    test_size: NonNegInt = 0


class Distill(OnPolicy, kw_only=True):
    """On-policy distillation (cookbook distillation/train_on_policy.py): the student samples, each teacher scores the
    student's own tokens (compute_logprobs), and the per-token reverse KL student_lp − teacher_lp is a penalty on the
    advantages (no centring; optionally discounted). Trained with a built-in ratio loss like RL, in any RL mode."""

    implementation: ClassVar[str] = "runner.algos.distill"

    datasets: Annotated[list[DistillSet], Meta(min_length=1)]
    # Samples per prompt (their reward is 0: only the KL term carries signal).
    group_size: PosInt = 4
    kl_coef: PosFloat = 1.0
    # 0: each token pays its own KL; γ > 0: a token also pays the discounted KL of the tokens after it.
    kl_discount: Annotated[float, Meta(ge=0, lt=1)] = 0.0

    @property
    def groups_per_batch(self) -> int:
        return sum(d.groups_per_batch for d in self.datasets)


class Generate(AlgoBase):
    """Sample a teacher over prompts and write the conversations (without `system`) to the run dir's generated/,
    for an SFT recipe to train on (`data = {kind = "run_output", run = "#this"}`): the first stage of prompt
    distillation. Resumable and seeded like any run; it trains nothing."""

    implementation: ClassVar[str] = "runner.algos.generate"

    # Rows {"messages": [...]} ending with the user's turn.
    prompts: DataSource
    # The teacher's system prompt, which the written conversations leave out.
    system: str | None = None
    teacher: Teacher = Teacher()
    # Replies per prompt.
    n: PosInt = 1
    # Prompts per step.
    batch_size: PosInt = 64
    max_tokens: PosInt = 64
    # 0 = greedy.
    temperature: NonNegFloat = 0.0
    # Keep replies cut off by max_tokens (default: drop them, and count them).
    keep_truncated: bool = False


# A user's algorithm: an `AlgoSpec` in their module (runner/engine/spec.py, examples/custom_algo.py).
SpecRef = Annotated[str, Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w]*$", description="'pkg.mod:SPEC'")]


class Custom(AlgoBase):
    """A user-defined algorithm: `spec = "pkg.mod:SPEC"` names an AlgoSpec; `args` is validated by its config struct
    (`runner check`)."""

    spec: SpecRef
    args: dict[str, Any] = {}

    @property
    def target(self) -> str:
        return self.spec


# Every algorithm, in the order declared above: a new one is its struct here (naming its module) and that module.
ALGO_VARIANTS: tuple[type[AlgoBase], ...] = variants(AlgoBase)
if TYPE_CHECKING:
    Algo = AlgoBase
else:
    Algo = Union[ALGO_VARIANTS]  # noqa: UP007 - built from the variants at import


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


class Log(Base):
    # Where metrics go besides metrics.jsonl (default: nowhere). Changing this table never stops a resume.
    wandb: WandB | None = None


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
    overrides: dict[str, Any] = {}




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
    renderer: str = "auto"
    backend: Backend = Local()
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
    # Experiment tracking (e.g. log = {wandb = {project = "my-project"}}); off by default.
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

        if self.renderer not in renderer_names() and re.fullmatch(TARGET_PATTERN, self.renderer) is None:
            raise ValueError(f"renderer {self.renderer!r} is unknown{did_you_mean(self.renderer)}; choose one of: "
                             f"{', '.join(renderer_names())}, or your own as 'pkg.mod:NAME'")
        if isinstance(self.algo, RL) and isinstance(self.algo.mode, Async) and self.depth == 0:
            raise ValueError("algo.mode async samples while the previous step trains: it needs depth >= 1")
