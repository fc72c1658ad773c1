"""Model shapes of the MoE layers moetune tunes for (hidden, intermediate, experts, top-k)."""

from __future__ import annotations

import msgspec

from moetune.runtime.knobs import int_of_text

# The largest dimension a shape may have: what a profile key can carry to and from a daemon (runtime/wire.py
# POS_INT_MAX, the most a get_profile request takes; a test holds the two equal). A custom shape past it was taken and
# failed later: as an OverflowError out of the database read of `moetune query` and `ProfileClient.resolve`.
MAX_DIMENSION = 1 << 31


class ModelShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    hidden: int
    intermediate: int
    experts: int
    topk: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"model shape: name must be a str, got {type(self.name).__name__}")
        for field in ("hidden", "intermediate", "experts", "topk"):
            # the constructor does not type-check (msgspec does so only when decoding): 256.0 would pass here
            if type(getattr(self, field)) is not int:
                raise TypeError(f"model shape {self.name!r}: {field} must be an int, got "
                                f"{type(getattr(self, field)).__name__} {getattr(self, field)!r}")
            if getattr(self, field) <= 0:
                raise ValueError(f"model shape {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
            if getattr(self, field) > MAX_DIMENSION:
                raise ValueError(f"model shape {self.name[:64]!r}: {field} must be at most {MAX_DIMENSION}, got "
                                 f"{str(getattr(self, field))[:32]}")
        if self.topk > self.experts:
            raise ValueError(f"model shape {self.name!r}: topk {self.topk} > experts {self.experts}")
        if not isinstance(self.dtype, str):  # a list was "unhashable type" out of the DTYPES lookup, naming nothing
            raise TypeError(f"model shape {self.name!r}: dtype must be a str (one of {', '.join(DTYPES)}), got "
                            f"{type(self.dtype).__name__} {str(self.dtype)[:32]!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model shape {self.name!r}: dtype {self.dtype!r} not one of {', '.join(DTYPES)}")

    def check_ep(self, ep_size: int) -> None:
        """ValueError unless this model's experts spread evenly over an EP group of `ep_size` ranks."""
        check_experts_divide(self.experts, ep_size, self.name)

    @property
    def token_bytes(self) -> int:
        return self.hidden * DTYPES[self.dtype]


def check_experts_divide(experts: int, ep_size: int, who: str) -> None:
    """ValueError unless `experts` split evenly over `ep_size` ranks: every rank holds experts // ep_size of them
    (the runtime's layout, the fabric model and the tuner assume it). The one rule for the CLI and a profile key."""
    if ep_size < 1 or experts % ep_size:
        raise ValueError(f"{who}: {experts} experts do not divide evenly over an EP group of {ep_size}")


# the most tokens per GPU (rank) moetune takes: the fabric model's workloads (`model predict`/`sweep`) and `query`
MAX_TOKENS_PER_GPU = 1 << 22  # 4M


def tokens_per_gpu_problem(tokens: int) -> str:
    """Why `tokens` is no token count per GPU ('' when it is one: 1 .. MAX_TOKENS_PER_GPU), worded to follow the
    name of what carries it ("--tokens must be >= 1, got 0"). The one rule of the fabric model's Workload and the
    CLI's single token counts."""
    if tokens < 1:
        return f"must be >= 1, got {tokens}"
    if tokens > MAX_TOKENS_PER_GPU:
        return f"{tokens} is beyond what moetune handles (at most {MAX_TOKENS_PER_GPU}, 4M)"
    return ""


DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(name="qwen3-30b", hidden=2048, intermediate=768, experts=128, topk=8),
        ModelShape(name="gpt-oss-120b", hidden=2880, intermediate=2880, experts=128, topk=4),
        ModelShape(name="deepseek-v3", hidden=7168, intermediate=2048, experts=256, topk=8),
    )
}


def get_model(spec: str) -> ModelShape:
    """A known name (`qwen3-30b`) or a custom shape `custom:H,I,E,K[,dtype]`."""
    if not isinstance(spec, str):
        raise TypeError(f"model spec must be a str (a name or custom:H,I,E,K[,dtype]), got {type(spec).__name__}")
    if spec in MODELS:
        return MODELS[spec]
    if spec.startswith("custom:"):
        parts = spec[len("custom:") :].split(",")
        if len(parts) not in (4, 5):
            raise ValueError(f"custom model {spec!r}: expected custom:HIDDEN,INTERMEDIATE,EXPERTS,TOPK[,DTYPE]")
        # int_of_text, not int(): int() reads "1_28" as 128 and any Unicode digits; blanks around a field stay allowed
        try:
            dims = [int_of_text(p.strip()) for p in parts[:4]]
        except ValueError:  # past int()'s digit limit
            dims = [None]
        if None in dims:
            raise ValueError(f"custom model {spec!r}: the first four fields must be integers")
        h, i, e, k = (d for d in dims if d is not None)
        dtype = parts[4].strip() if len(parts) == 5 else None
        # the name written one way (`custom:256,128,8,2`), not as given: with the blanks or signs kept, one shape went
        # by two names, and a ModelShape compares by its name too (MoELayer refused an EPBuffer of the same shape)
        name = f"custom:{h},{i},{e},{k}" + (f",{dtype}" if dtype is not None else "")
        return ModelShape(name=name, hidden=h, intermediate=i, experts=e, topk=k, dtype=dtype or "bfloat16")
    raise ValueError(f"unknown model {spec!r}; known: {', '.join(MODELS)} or custom:H,I,E,K[,dtype]")
