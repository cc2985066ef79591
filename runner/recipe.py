"""The whole recipe schema, and the only reader of recipe TOML.

A recipe file holds named recipes under `[recipes.<name>]`; `FILE#name` selects one. Each table is
decoded on its own with msgspec (unknown keys forbidden, tagged unions for every choice, limits in the
types), so an error names the file, the recipe and the key path. Overrides `a.b=value` are merged into
the raw table before decoding, so they get the same checks. Precedence: CLI > recipe > defaults.

Reading: load_recipe("FILE#name", overrides) -> (name, Recipe); load_file(FILE) -> {name: Recipe}.
Writing: dump_recipe(name, recipe) -> TOML that loads back to an equal Recipe (`runner show`).
Checking what decoding cannot see: check_recipe (data files exist, Python targets import).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import inspect
import os
import re
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from datetime import date, datetime, time
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect as mi
import tomli_w
from msgspec import Meta

from runner.errors import UserError

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Frac = Annotated[float, Meta(ge=0, le=1)]
# User code, "pkg.mod:fn". `runner check` imports every field of this type, wherever it appears.
TARGET_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
Target = Annotated[str, Meta(pattern=TARGET_PATTERN, description="'pkg.mod:fn'")]


class Base(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # Subclasses inherit frozen=True (msgspec). pyright reports "a non-frozen class cannot inherit from a
    # frozen class" for each of them: its dataclass_transform model does not inherit the option.
    pass


# ---------------------------------------------------------------- backends

class BackendBase(Base, tag_field="kind", tag=str.lower):
    pass


class Local(BackendBase):
    """In-process torch trainer and sampler (backends/local)."""

    # "auto": cuda if available, else cpu. Chosen in one place: backends/local/device.py.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": bfloat16 on cuda, float32 on cpu (bit-for-bit reproducible there).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # LoRA scaling numerator (scale = alpha / rank); Tinker does not expose it.
    lora_alpha: PosFloat = 32.0
    # Train every weight instead of a LoRA adapter (local only; Tinker trains LoRA).
    full_finetune: bool = False


class Tinker(BackendBase):
    """The hosted Tinker service or any Tinker-compatible server (backends/tinker.py)."""

    # None: $TINKER_BASE_URL, else the SDK's default (hosted service). The API key comes from
    # $TINKER_API_KEY only and is never written anywhere.
    base_url: str | None = None
    # Lifetime of periodic checkpoints on the service (its limits: 1 hour to 10 years); the final
    # checkpoint never expires. Not optional: TOML has no null, so `show` could not write None back.
    ttl_seconds: Annotated[int, Meta(ge=3600, le=10 * 365 * 24 * 3600)] = 7 * 24 * 3600


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


# ---------------------------------------------------------------- data sources

class DataBase(Base, tag_field="kind", tag=str.lower):
    pass


class Jsonl(DataBase):
    """A local JSONL file, one example per line; relative paths are relative to the working directory."""

    path: str


class HF(DataBase):
    """A Hugging Face dataset by hub name (needs the hub, or its offline cache) or a local dataset folder."""

    name: str
    split: str = "train"
    subset: str | None = None


class Python(DataBase):
    """User code: `target = "pkg.mod:fn"`, called as fn(**args); imported and checked by `runner check`."""

    target: Target
    args: dict[str, Any] = {}


DataSource = Jsonl | HF | Python


# ---------------------------------------------------------------- algorithms

class AlgoBase(Base, tag_field="kind", tag=str.lower):
    pass


class SFT(AlgoBase):
    """Supervised fine-tuning on conversations: {"messages": [{"role", "content"}, ...]} per row."""

    data: DataSource
    # Conversations per step.
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Truncate rendered conversations (tokens) from the right. Always set (TOML has no null): use a
    # large value to keep whole conversations.
    max_length: PosInt = 1024
    train_on_what: Literal["last_assistant_message", "all_assistant_messages", "all_messages"] = (
        "all_assistant_messages"
    )
    # "mean": each conversation's token weights sum to 1 (the cookbook's default); "none": 1 per token.
    reduction: Literal["mean", "none"] = "mean"
    # Rows held out (after the seeded shuffle) for the eval NLL; 0 = no eval.
    test_size: NonNegInt = 0


# ---------------------------------------------------------------- RL: environments

class EnvBase(Base, tag_field="kind", tag=str.lower):
    # Problems in the training split (batches = train_size // groups_per_batch) and held out for evals.
    train_size: PosInt = 10_000
    test_size: NonNegInt = 64


class Arithmetic(EnvBase):
    """Single turn: "What is x + y?". reward = correct + 0.1·(format − 1), format = an integer reply that ended
    on the stop token (the cookbook's math_rl `arithmetic`)."""

    min_value: int = 0
    max_value: int = 99
    # Prepend one solved example ("What is 4 + 5?" → "9") so a small model sees the answer format.
    few_shot: bool = True

    def __post_init__(self) -> None:
        if self.max_value < self.min_value:
            raise ValueError("max_value must be >= min_value")


class GuessNumber(EnvBase, tag="guess_number"):
    """Multi-turn: guess a secret integer in [low, high]; the env answers "higher", "lower" or "correct".
    reward = 1 − (guesses − 1)/max_turns on success, 0 when out of turns, −1 for a reply that is not an integer."""

    low: int = 0
    high: int = 1023
    max_turns: PosInt = 10

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high must be >= low")


class TwentyQuestions(EnvBase, tag="twenty_questions"):
    """Multi-turn: find an object from a fixed table by yes/no questions about its attributes, then
    "Guess: <name>". reward 1 for a correct guess within max_turns, else 0. Test objects are held out."""

    # The table needs about five well-chosen questions; 12 turns keep a byte-level conversation inside the
    # tiny model's 2048-token context at max_tokens 32 (longer prompts drop the group: ContextOverflow).
    max_turns: PosInt = 12
    train_size: PosInt = 2_000
    test_size: NonNegInt = 4


class TicTacToe(EnvBase, tag="tictactoe"):
    """Reply with a cell 1-9. "self": both seats are the policy (group_size/2 games per group); otherwise the
    policy plays a random seat against a fixed opponent. win 1, draw 0, loss −1; an illegal move loses."""

    opponent: Literal["self", "random", "optimal"] = "self"
    test_opponent: Literal["random", "optimal"] = "random"


class Preference(EnvBase):
    """Single turn; the group's replies are judged pairwise, round-robin, both orders; reward = win fraction
    + format_coef·(ended_on_stop − 1). The judge is fn(prompt, a, b) -> P(a better) in [0, 1]."""

    prompts: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["Who are you?"])
    # Held-out prompts for evals (test_size is not used here).
    test_prompts: list[str] = []
    # None: the shorter reply wins (the cookbook's `shorter` recipe). Else "pkg.mod:fn".
    judge: Target | None = None
    format_coef: NonNegFloat = 0.1


class PythonEnv(EnvBase, tag="python", kw_only=True):
    """User code: target "pkg.mod:fn" is called as fn(**args) and returns a dataset builder, a callable
    builder(ctx: runner.rl.envs.EnvContext) -> (train: RLDataset, test: RLDataset | None).
    train_size / test_size are not used (the builder decides)."""

    target: Target
    args: dict[str, Any] = {}


Env = Arithmetic | GuessNumber | TwentyQuestions | TicTacToe | Preference | PythonEnv


# ---------------------------------------------------------------- RL: losses (Tinker's built-ins; tinker-sdk.md §3)


class LossBase(Base, tag_field="kind", tag=str.lower):
    pass


class ImportanceSampling(LossBase, tag="importance_sampling"):
    """−Σ r·A, r = exp(lp − lp_sampler)."""


class PPO(LossBase):
    """−Σ min(r·A, clip(r, lo, hi)·A). The bounds are on the ratio itself, not epsilons."""

    clip_low: NonNegFloat = 0.8
    clip_high: PosFloat = 1.2

    def __post_init__(self) -> None:
        if self.clip_low >= self.clip_high:
            raise ValueError("clip_low must be < clip_high")


class CISPO(LossBase):
    """−Σ sg(clip(r, lo, hi))·lp·A. Default one-sided (Tinker's)."""

    clip_low: NonNegFloat = 0.0
    clip_high: PosFloat = 4.0

    def __post_init__(self) -> None:
        if self.clip_low >= self.clip_high:
            raise ValueError("clip_low must be < clip_high")


class DRO(LossBase):
    """−Σ (lp·A − ½·β·(lp − lp_sampler)²)."""

    beta: PosFloat = 0.05


Loss = ImportanceSampling | PPO | CISPO | DRO


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


class RL(AlgoBase):
    """Group-relative policy gradient on environments (cookbook rl/train.py): per group, advantage = reward −
    group mean; datums carry sampler logprobs and per-token advantages; a built-in ratio loss."""

    env: Env
    # ---- Core
    # Episodes per group (the baseline is their mean reward; 1 would make every advantage 0).
    group_size: Annotated[int, Meta(ge=2)] = 4
    groups_per_batch: PosInt = 16
    # Sampled tokens per turn.
    max_tokens: PosInt = 64
    temperature: PosFloat = 1.0
    loss: Loss = ImportanceSampling()
    # ---- Advanced
    kl: KL = NoKL()
    mode: Mode = Sync()
    # optim_steps per batch (contiguous chunks of the batch; later chunks train slightly off-policy).
    num_substeps: PosInt = 1
    # Drop groups whose rewards are all equal (they carry no signal, only KL/entropy drift).
    remove_constant_reward_groups: bool = False
    # Divide advantages by the group's reward std (off, as in the cookbook: the std couples reward scale and step size).
    normalize_std: bool = False
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

    def __post_init__(self) -> None:
        if isinstance(self.env, TicTacToe) and self.env.opponent == "self" and self.group_size % 2:
            raise ValueError("tictactoe self-play needs an even group_size (two seats per game)")
        if self.num_substeps > self.groups_per_batch:
            raise ValueError("num_substeps must be <= groups_per_batch")
        if isinstance(self.mode, Stream):
            per_substep, rem = divmod(self.groups_per_batch, self.num_substeps)
            if rem or per_substep % self.mode.minibatches:
                raise ValueError("stream mode: groups_per_batch must split evenly into num_substeps × minibatches")


Algo = SFT | RL


# ---------------------------------------------------------------- the recipe

class Recipe(Base):
    # ---- Core
    algo: Algo
    # Base model. Local: "tiny" (the embedded default), a Hugging Face model folder, or a cached hub id.
    # Tinker: the service's model name, e.g. "Qwen/Qwen3-8B".
    model: str = "tiny"
    # Tokenizer folder or name when it differs from the model's (e.g. offline use of a Tinker model).
    tokenizer: str | None = None
    backend: Local | Tinker = Local()
    seed: int = 0
    # Peak learning rate.
    lr: PosFloat = 1e-4
    # Cap on optimizer steps (default: every batch of every epoch).
    max_steps: PosInt | None = None
    # Run directory; default runs/<recipe name>.
    log_dir: str | None = None

    # ---- Advanced
    lora: LoRA = LoRA()
    optim: Optim = Optim()
    schedule: Schedule = Linear()
    # Steps submitted ahead of the one being finished; 0 = fully synchronous.
    depth: Annotated[int, Meta(ge=0, le=64)] = 1
    # Steps between evals / checkpoints; 0 = never (a final checkpoint is always written). Evals run before
    # steps 0, N, 2N, ...; RL also evaluates the final weights once after the last step (logged at step =
    # the number of steps, as the cookbook) when eval_every > 0 and there is a test set. SFT has no final eval.
    eval_every: NonNegInt = 10
    save_every: NonNegInt = 20
    # An existing run dir: resume it (only if it holds this same recipe), move it aside, or stop.
    if_exists: Literal["resume", "overwrite", "error"] = "resume"

    def __post_init__(self) -> None:
        if isinstance(self.algo, RL) and isinstance(self.algo.mode, Async) and self.depth == 0:
            raise ValueError("algo.mode async samples while the previous step trains: it needs depth >= 1")


# ================================================================ reading recipe files
#
# Everything below turns TOML text into a Recipe, or into one line that says what to fix. msgspec's
# errors carry a path (`$.algo.batch_size`) but not the choices or the offending value, so `_explain`
# walks the schema (msgspec.inspect) along the raw data to add them. It knows no field by name: new
# variants of any union get the same messages.

T = TypeVar("T")
DEFAULT_FILE = "recipes.toml"
# Recipe names become run directories (runs/<name>) and appear in `FILE#name`: keep them plain.
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_MISSING: Any = object()


def load_file(path: str) -> dict[str, Recipe]:
    """Every recipe in a file, by name; the first bad one raises UserError."""
    return {name: decode_recipe(raw, f"{path}#{name}") for name, raw in read_tables(path).items()}


def load_recipe(ref: str, overrides: Sequence[str] = ()) -> tuple[str, Recipe]:
    """`FILE#name` (or just FILE when it holds one recipe) with `a.b=value` overrides applied."""
    path, name = split_ref(ref)
    tables = read_tables(path)
    if name is None:
        if len(tables) != 1:
            raise UserError(f"{path}: pick a recipe as {path}#NAME; available: {', '.join(sorted(tables))}")
        name = next(iter(tables))
    if name not in tables:
        raise UserError(f"{path}: no recipe named {name!r}; available: {', '.join(sorted(tables))}")
    where = f"{path}#{name}"
    recipe = decode_recipe(apply_overrides(tables[name], overrides, where), where)
    # User modules ("pkg.mod:fn" targets) may live next to the recipe file: importable after the working
    # directory (import_target puts that first).
    folder = str(Path(path).parent.resolve())
    if folder not in sys.path:
        sys.path.append(folder)
    return name, _data_next_to_recipe(recipe, where, Path(path).parent)


def _data_next_to_recipe(recipe: Recipe, where: str, base: Path) -> Recipe:
    """A relative data path is relative to the working directory; one that is not there but is next to the
    recipe file (`runner run ~/proj/recipes.toml#x` from elsewhere) becomes that file's absolute path, which
    config.toml then records."""
    fixes = []
    for keys, node in _structs(recipe, ()):
        if isinstance(node, Jsonl):
            rel = Path(node.path)
            if not rel.is_absolute() and not rel.is_file() and (base / rel).is_file():
                fixes.append((keys, str((base / rel).resolve())))
    if not fixes:
        return recipe
    raw = msgspec.to_builtins(recipe)
    for keys, value in fixes:
        table = raw
        for key in keys:
            table = table[key]
        table["path"] = value
    return decode_recipe(raw, where)


def split_ref(ref: str) -> tuple[str, str | None]:
    """'FILE#name' -> (FILE, name); 'FILE' -> (FILE, None)."""
    path, sep, name = ref.rpartition("#")
    if not sep:
        return ref, None
    if not path or not _NAME.match(name):
        raise UserError(f"bad recipe reference {ref!r}: expected FILE#NAME, e.g. {DEFAULT_FILE}#sl_basic")
    return path, name


def read_tables(path: str) -> dict[str, dict[str, Any]]:
    """The raw `[recipes.<name>]` tables of a file, undecoded."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: {'not a file' if p.exists() else 'file not found'}")
    try:
        data = tomllib.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: {_toml_error(e)}") from None
    if "recipes" not in data:
        raise UserError(f"{path}: no [recipes] table; write each recipe as [recipes.<name>]")
    for key in data:
        if key != "recipes":
            raise UserError(f"{path}: {key}: unknown top-level key; write each recipe as [recipes.<name>]")
    tables = data["recipes"]
    if not isinstance(tables, dict):
        raise UserError(f"{path}: recipes: expected a table of [recipes.<name>] tables, got {_got(tables)}")
    if not tables:
        raise UserError(f"{path}: [recipes] is empty; write each recipe as [recipes.<name>]")
    for name, raw in tables.items():
        if not _NAME.match(name):
            raise UserError(f"{path}: recipe name {name!r}: use only letters, digits, '_' and '-'")
        if not isinstance(raw, dict):
            raise UserError(f"{path}#{name}: expected a table [recipes.{name}], got {_got(raw)}")
    return tables


def decode_recipe(raw: dict[str, Any], where: str) -> Recipe:
    """Validate one raw recipe table; `where` ('FILE#name') prefixes the error."""
    return convert(raw, Recipe, where)


def convert(raw: Any, type_: type[T], where: str) -> T:
    """msgspec.convert, with a failure turned into a one-line UserError (works for any struct type)."""
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as e:
        raise UserError(f"{where}: {_explain(str(e), raw, type_)}") from None


def _toml_error(e: tomllib.TOMLDecodeError) -> str:
    # tomllib (3.11) only puts the position in the message: "Invalid value (at line 12, column 5)".
    m = re.fullmatch(r"(.*) \(at (line \d+, column \d+|end of document)\)", str(e))
    if m is None:
        return f"TOML syntax error: {e}"
    reason, pos = m.groups()
    pos = "end of file" if pos == "end of document" else pos
    return f"TOML syntax error at {pos}: {reason[:1].lower()}{reason[1:]}"


# ---------------------------------------------------------------- overrides

def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value). The value is a TOML literal, else the plain string."""
    key, sep, value = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(_NAME.match(k) for k in keys):
        raise UserError(f"bad override {text!r}: expected KEY=VALUE, e.g. lr=3e-4 or lora.rank=8")
    try:
        doc = tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        return keys, value.strip()
    # "x\nlr = 1" parses as two keys: that is not one literal, so keep the text.
    return keys, doc["v"] if len(doc) == 1 else value.strip()


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], where: str) -> dict[str, Any]:
    """A copy of `raw` with each override set at its path (CLI > recipe > defaults).

    A value replaces what was there (`backend={kind="tinker"}` switches variant). A missing table on
    the way starts from the field's default, so `schedule.warmup_steps=5` keeps the default schedule."""
    out = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        node, t = out, _info(Recipe)
        for i, key in enumerate(keys[:-1]):
            t, field = _child(t, node, key)
            if key not in node:
                node[key] = _seed(field.default if field is not None else None)
            node = node[key]
            if not isinstance(node, dict):
                dotted = ".".join(keys[: i + 1])
                raise UserError(f"{where}: {dotted}: is {_got(node)}, not a table, so {text!r} cannot set it")
        t, _ = _child(t, node, keys[-1])
        # `model=1e3` or `tokenizer=true` parse as numbers/bools; a str-only field takes the text.
        if not isinstance(value, str) and t is not None and _is_str(t):
            value = text.partition("=")[2].strip()
        node[keys[-1]] = value
    return out


def _seed(default: Any) -> dict[str, Any]:
    """The raw table of a default struct: its tag and the fields that differ from their own defaults
    (so an override of the tag alone, `backend.kind=tinker`, does not drag the old variant's fields)."""
    if not isinstance(default, msgspec.Struct):
        return {}
    info = _info(type(default))
    out: dict[str, Any] = {info.tag_field: info.tag} if info.tag_field else {}
    for f in info.fields:
        value = getattr(default, f.name)
        own = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        if value != own:
            out[f.encode_name] = msgspec.to_builtins(value)
    return out


# ---------------------------------------------------------------- walking the schema with the data

def _resolve(t: Any, raw: Any) -> Any:
    """The concrete type at a node: Metadata unwrapped, None dropped, a tagged union narrowed by the
    raw tag. An unresolvable union comes back as is."""
    if isinstance(t, mi.Metadata):
        return _resolve(t.type, raw)
    if isinstance(t, mi.UnionType):
        types = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if len(types) == 1:
            return _resolve(types[0], raw)
        structs = [s for s in (_resolve(m, raw) for m in types) if isinstance(s, mi.StructType)]
        if isinstance(raw, dict):
            for s in structs:
                if s.tag_field is not None and raw.get(s.tag_field) == s.tag:
                    return s
    return t


def _variants(t: Any) -> list[mi.StructType]:
    """The tagged struct choices at a node (one for a lone tagged struct, none if untagged)."""
    if isinstance(t, mi.Metadata):
        return _variants(t.type)
    if isinstance(t, mi.UnionType):
        return [v for m in t.types for v in _variants(m)]
    if isinstance(t, mi.StructType) and t.tag_field is not None:
        return [t]
    return []


def _child(t: Any, raw: Any, key: str | int) -> tuple[Any, mi.Field | None]:
    """(type, field) one step down from type `t` holding `raw`; (None, None) if the schema says nothing."""
    t = _resolve(t, raw)
    if isinstance(t, mi.StructType) and isinstance(key, str):
        if key == t.tag_field:
            return mi.LiteralType(values=(t.tag,)), None
        for f in t.fields:
            if f.encode_name == key:
                return f.type, f
    if isinstance(t, mi.DictType):
        return t.value_type, None
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return getattr(t, "item_type", None), None
    return None, None


def _is_str(t: Any) -> bool:
    t = _resolve(t, None)
    return isinstance(t, mi.StrType) or (isinstance(t, mi.LiteralType) and all(isinstance(v, str) for v in t.values))


def _get(raw: Any, key: str | int) -> Any:
    if isinstance(raw, dict) and isinstance(key, str):
        return raw.get(key, _MISSING)
    if isinstance(raw, list) and isinstance(key, int) and key < len(raw):
        return raw[key]
    return _MISSING


# ---------------------------------------------------------------- msgspec errors -> one line

def _explain(message: str, raw: Any, root: Any) -> str:
    """'Expected `int` >= 1 - at `$.algo.batch_size`' -> 'algo.batch_size: expected int >= 1, got 0'."""
    text, _, loc = message.partition(" - at `$")
    parts: list[str | int] = []
    t, node, parent_t = _info(root), raw, None
    for name, index in re.findall(r"\.([^.\[`]+)|\[(\d+|\.\.\.)\]", loc):
        if name:
            key: str | int = name
        elif index == "...":  # a dict entry, which msgspec does not name
            key = _bad_key(raw, parts, node, root, message)
        else:
            key = int(index)
        parent_t = t
        t, _ = _child(t, node, key)
        node = _get(node, key)
        parts.append(key)
    path = _dotted(parts)
    where = f"{path}: " if path else ""

    if m := re.fullmatch(r"Object contains unknown field `(.+)`", text):
        key = m.group(1)
        s = _resolve(t, node)
        valid = sorted([f.encode_name for f in s.fields] + ([s.tag_field] if s.tag_field else [])) if isinstance(
            s, mi.StructType
        ) else []
        close = difflib.get_close_matches(str(key), valid, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        return f"{_dotted([*parts, key])}: unknown key{hint} (valid: {', '.join(valid)})"

    if m := re.fullmatch(r"Object missing required field `(.+)`", text):
        key = m.group(1)
        variants = _variants(t)
        if variants and key == variants[0].tag_field:
            return f"{_dotted([*parts, key])}: missing key; expected one of: {_tags(variants)}"
        ft, _ = _child(t, node, key)
        return f"{_dotted([*parts, key])}: missing key; {_expected(ft, key)}"

    # A bad tag (wrong value or wrong type) is a bad choice among the parent's variants.
    pv = _variants(parent_t) if parts else []
    if pv and parts[-1] == pv[0].tag_field:
        return f"{where}invalid choice {_show(node)}; expected one of: {_tags(pv)}"
    if re.fullmatch(r"Invalid (enum )?value .*", text):
        lit = _resolve(t, node)
        choices = ", ".join(map(str, lit.values)) if isinstance(lit, mi.LiteralType) else "?"
        return f"{where}invalid choice {_show(node)}; expected one of: {choices}"

    if m := re.fullmatch(r"Expected `([^`]+)`, got `[^`]+`", text):
        names = [n for n in m.group(1).split(" | ") if n != "null"]
        if "object" in names and _variants(t):
            return f"{where}expected a table, got {_got(node)}; {_table_hint(t, parts[-1] if parts else '', node)}"
        return f"{where}expected {' or '.join(map(_type_name, names))}, got {_got(node)}"

    if m := re.fullmatch(r"Expected `([^`]+)` (.+)", text):
        # A Target declared without our description (same pattern) still reads as 'pkg.mod:fn'.
        desc = _description(t) or ("'pkg.mod:fn'" if _is_target(t) else None)
        want = desc or f"{_type_name(m.group(1))} {m.group(2)}"
        shown = _got(node) if isinstance(node, (dict, list)) else _show(node)
        return f"{where}expected {want}, got {shown}"

    # __post_init__ ValueErrors and anything new: msgspec's text, with our path.
    return f"{where}{text}"


def _type_name(msgspec_name: str) -> str:
    return "table" if msgspec_name == "object" else msgspec_name


def _bad_key(raw: Any, parts: list[str | int], node: dict[str, Any], root: Any, message: str) -> str:
    """msgspec reports a dict entry as `[...]`: find the key by re-checking with one entry at a time."""
    for key, value in node.items():
        trial = copy.deepcopy(raw)
        target = trial
        for p in parts:
            target = target[p]
        target.clear()
        target[key] = value
        try:
            msgspec.convert(trial, root)
        except msgspec.ValidationError as e:
            if str(e) == message:
                return key
    return "..."


def _expected(t: Any, key: str | int) -> str:
    if _variants(t):
        return _table_hint(t, key, _MISSING)
    desc = _description(t)
    if desc:
        return f"expected {desc}"
    r = _resolve(t, None)
    if isinstance(r, mi.StructType | mi.DictType):
        return "expected a table"
    if isinstance(r, mi.LiteralType):
        return f"expected one of: {', '.join(map(str, r.values))}"
    limits = [f"{op} {getattr(r, name)}" for name, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if getattr(r, name, None) is not None]
    return f"expected {' '.join([_type_name(type(r).__name__.removesuffix('Type').lower()), *limits])}"


def _table_hint(t: Any, key: str | int, value: Any) -> str:
    variants = _variants(t)
    tags = [v.tag for v in variants]
    tag, field = (value if value in tags else tags[0]), variants[0].tag_field
    return f'write e.g. {key} = {{{field} = "{tag}"}} ({field} one of: {_tags(variants)})'


def _tags(variants: list[mi.StructType]) -> str:
    return ", ".join(sorted(str(v.tag) for v in variants))


def _description(t: Any) -> str | None:
    """A `Meta(description=...)` on the type: says what a pattern means better than the regex."""
    t = _non_null(t)
    if isinstance(t, mi.Metadata) and t.extra_json_schema:
        return t.extra_json_schema.get("description")
    return None


def _non_null(t: Any) -> Any:
    """`X | None` -> X (still wrapped in its Metadata, if any)."""
    if isinstance(t, mi.UnionType):
        types = [m for m in t.types if not isinstance(m, mi.NoneType)]
        return types[0] if len(types) == 1 else t
    return t


def _dotted(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            p = p if _NAME.match(p) else f'"{p}"'
            out += f".{p}" if out else p
    return out


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is _MISSING:
        return "nothing"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _got(v: Any) -> str:
    """A raw value with its TOML type: "str 'fast'", 'table', 'array [1, 2]'."""
    if isinstance(v, dict):
        return "table"
    name = {list: "array"}.get(type(v), type(v).__name__)
    return f"{name} {_show(v)}"


# ---------------------------------------------------------------- writing back, and checking

def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """Every field, defaults included, as TOML-ready builtins. None is left out: TOML has no null,
    and every optional field defaults to None, so leaving it out reads back the same."""
    return _drop_none(msgspec.to_builtins(recipe, builtin_types=(datetime, date, time)))


def dump_recipe(name: str, recipe: Recipe) -> str:
    """The fully resolved recipe as TOML, wrapped as [recipes.<name>]; loads back to an equal Recipe."""
    return tomli_w.dumps({"recipes": {name: recipe_dict(recipe)}})


def _drop_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


def check_recipe(recipe: Recipe, where: str) -> None:
    """What decoding cannot see: data files exist (relative to the working directory) and every
    `Target` field imports and is callable. Raises UserError prefixed with `where` ('FILE#name')."""
    for path, node in _structs(recipe, ()):
        if isinstance(node, Jsonl) and not Path(node.path).is_file():
            looked = "" if Path(node.path).is_absolute() else f" (looked in {os.getcwd()} and next to the recipe file)"
            raise UserError(f"{where}: {_dotted([*path, 'path'])}: data file not found: {node.path}{looked}")
        for field in _info(type(node)).fields:
            value = getattr(node, field.name)
            if isinstance(value, str) and _is_target(field.type):
                try:
                    fn = import_target(value)
                except UserError as e:
                    raise UserError(f"{where}: {_dotted([*path, field.encode_name])}: {e}") from None
                # A target called as fn(**args) (python data sources and envs): the args must fit its signature.
                args = getattr(node, "args", None) if field.name == "target" else None
                problem = args_mismatch(fn, args) if isinstance(args, dict) else None
                if problem and isinstance(args, dict):
                    raise UserError(f"{where}: {_dotted([*path, 'args'])}: {value!r} cannot be called with "
                                    f"args {sorted(args)}: {problem}")


def import_target(target: str) -> Callable[..., Any]:
    """The callable named by 'pkg.mod:fn'; UserError if it does not import or is not callable."""
    module, _, attr = target.partition(":")
    # The console script does not put the working directory on sys.path (`python -m` does); user
    # modules live next to the recipe, so both entry points must find them.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - any failure inside user code is the user's to fix
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(f"cannot import {target!r}: {reason}") from None
    if not callable(fn):
        raise UserError(f"{target!r} is {type(fn).__name__}, not a callable")
    return fn


def args_mismatch(fn: Callable[..., Any], args: dict[str, Any]) -> str | None:
    """Why fn(**args) cannot bind (a missing or unexpected argument), or None when it can or fn has no signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: the call will tell
        return None
    try:
        sig.bind(**args)
    except TypeError as e:
        return str(e)
    return None


@functools.cache
def _info(type_: Any) -> Any:
    return mi.type_info(type_)


def _is_target(t: Any) -> bool:
    t = _non_null(t)
    t = t.type if isinstance(t, mi.Metadata) else t
    return isinstance(t, mi.StrType) and t.pattern == TARGET_PATTERN


def _structs(v: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], msgspec.Struct]]:
    """Every struct inside a recipe, with its key path (through fields, lists and dict values)."""
    if isinstance(v, msgspec.Struct):
        yield path, v
        for name in v.__struct_fields__:
            yield from _structs(getattr(v, name), (*path, name))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _structs(x, (*path, i))
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _structs(x, (*path, k))
