"""Where a compiled step's time goes, read from its optimized HLO (`compiled.as_text()`): every kernel the device
launches, with its launches per step, FLOPs, HBM bytes and roofline time at a chip's peak (docs/compile.md, "How the
profile counts")."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter, defaultdict

import numpy as np

from diffjax.train.metrics import PEAK_FLOPS

# HBM bandwidth per device, bytes/s; the first name in the device kind wins (as PEAK_FLOPS). Sources: the H100 Tensor
# Core GPU, H200 and A100 (80GB SXM) datasheets; Google Cloud TPU system architecture pages (per chip).
HBM_BANDWIDTH = {
    "H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.039e12,
    "TPU v4": 1.2e12, "TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v5p": 2.765e12, "TPU v5": 2.765e12,
    "TPU v6 lite": 1.64e12, "TPU v6e": 1.64e12,
}
CHIPS = {"h100": "NVIDIA H100 SXM", "h200": "NVIDIA H200", "a100": "NVIDIA A100", "v4": "TPU v4",
         "v5e": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite"}  # short names -> device kinds

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
              "opt-barrier", "domain", "partition-id", "replica-id", "async-update", "async-done", "copy-done",
              "send-done", "recv-done", "all-reduce-done", "all-gather-done", "collective-permute-done"}
# XLA:TPU's bookkeeping calls: an allocation, a layout-only concatenation, an assumption, a collective's wait.
_NO_KERNEL_CALLS = {"AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound", "AsyncCollectiveDone"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all",
                "collective-broadcast", "all-reduce-start", "all-gather-start", "collective-permute-start", "send",
                "recv"}
_MOVES = {"parameter", "bitcast", "reshape", "copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice",
          "concatenate", "pad", "broadcast", "tuple", "get-tuple-element", "reverse", "constant", "iota"}
_SLICES = {"slice", "dynamic-slice"}
_COPIES = {"copy", "transpose", "copy-start", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "pad"}
_WRAPPERS = re.compile(r"^(jvp|transpose|vmap|pjit|remat|checkpoint|custom_jvp_call|custom_vjp_call)\(.*\)$")
_PLUMBING = {"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation", "remat", "branch"}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.size * _BYTES.get(self.dtype, 1 if self.dtype.startswith(("f8", "s8", "u8")) else 4)


def arrays(type_text: str) -> list[Array]:
    """The arrays of an HLO type (`bf16[4,2048]{1,0}`, or a tuple of them), in order."""
    return [Array(d, tuple(int(x) for x in dims.replace("<=", "").split(",") if x))
            for d, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,<=]*)\]", type_text)]


def _nbytes(arrays_: list[Array]) -> float:
    return sum(a.bytes for a in arrays_)


@dataclasses.dataclass
class Instruction:
    name: str
    type: str  # its HLO result type, e.g. "bf16[4,2048]{1,0}" or "(f32[], bf16[8])"
    opcode: str
    operands: list[str]
    args: str  # the operand list as written, e.g. "(%a, %b)" or a parameter's "(0)"
    attrs: str  # everything after the operand list

    @property
    def results(self) -> list[Array]:
        return arrays(self.type)

    def attr(self, key: str) -> str | None:
        found = re.search(rf"\b{key}=(%?[\w.\-$]+)", self.attrs)
        return found[1].lstrip("%") if found else None

    def quoted(self, key: str) -> str:  # a string attribute, `key="…"` ("" where there is none)
        found = re.search(rf'{key}="([^"]*)"', self.attrs)
        return found[1] if found else ""

    def called(self, key: str) -> list[str]:
        """Computations named by `key=%c` or `key={%a, %b}`."""
        found = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
        return re.findall(r"%?([\w.\-]+)", found[1].strip("{}")) if found else []

    @property
    def backend_config(self) -> dict:
        start = self.attrs.find("backend_config={")
        if start < 0:
            return {}
        try:
            return json.loads(_balanced(self.attrs, start + len("backend_config="), "{", "}"))
        except json.JSONDecodeError:
            return {}


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    root: str

    def shape(self, name: str) -> list[Array]:
        return self.instructions[name].results if name in self.instructions else []


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str

    def fused(self, ins: Instruction) -> Computation:
        return self.computations[ins.called("calls")[0]]


def _balanced(text: str, start: int, open_: str, close: str) -> str:
    """The text of the bracketed group opening at text[start]."""
    depth, i = 0, start
    while i < len(text):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
        elif text[i] == '"':  # strings may hold brackets
            i = text.index('"', i + 1)
        i += 1
    raise ValueError(f"unbalanced {open_}{close} in HLO: {text[start:start + 80]!r}")


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def parse(text: str) -> Module:
    """The computations of an HLO module's text (`compiled.as_text()`)."""
    computations, entry, current, root = {}, None, None, None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current, root = Computation(header[2], {}, ""), None
                entry = header[2] if header[1] else entry
        elif line.strip() == "}":
            current.root = root or next(reversed(current.instructions), "")
            computations[current.name], current = current, None
        elif found := _INSTRUCTION.match(line):
            ins = _instruction(found[2], found[3])
            current.instructions[ins.name] = ins
            root = ins.name if found[1] else root
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry)


def _instruction(name: str, rest: str) -> Instruction:
    type_text = _balanced(rest, 0, "(", ")") if rest.startswith("(") else rest.split(" ", 1)[0]
    rest = rest[len(type_text):].lstrip()
    opcode = re.match(r"[\w\-]+", rest)[0]
    args = _balanced(rest, len(opcode), "(", ")")
    return Instruction(name, type_text, opcode, re.findall(r"%([\w.\-]+)", args), args, rest[len(opcode) + len(args):])


@dataclasses.dataclass
class Kernel:
    """One top-level instruction that launches work on the device."""

    name: str
    op: str  # "fusion", "custom-call", "copy", ...
    kind: str  # the fusion kind (kLoop, kInput, kOutput, kCustom:<backend kind>) or the custom call's target
    category: str  # attention, matmul, norm, elementwise/fusion, copy/transpose, optimizer, collective or other
    phase: str  # forward, recompute (a remat's second forward), backward, optimizer or other
    scope: str  # the model scope from the op_name metadata, e.g. "layers/block/attn/head_norm"
    launches: int  # per step: the product of the enclosing loops' trip counts
    flops: float  # per launch
    bytes: float  # per launch
    op_name: str = ""

    def roofline_s(self, chip: Chip) -> float:  # one launch at the chip's peak
        return max(self.flops / chip.flops, self.bytes / chip.hbm)

    def bound(self, chip: Chip) -> str:
        return "compute" if self.flops / chip.flops >= self.bytes / chip.hbm else "memory"


@dataclasses.dataclass
class Profile:
    kernels: list[Kernel]
    unknown_trips: list[str]  # while loops counted once: no known trip count
    conditionals: list[str]  # conditionals of which one branch was counted
    unknown_flops: list[str] = dataclasses.field(default_factory=list)  # custom calls of unknown FLOPs (counted 0)


def profile(hlo_text: str) -> Profile:
    """Every kernel of a compiled program (its optimized HLO text), with its launches per step."""
    module = parse(hlo_text)
    found = Profile([], [], [])
    _walk(module, module.computations[module.entry], 1, found)
    found.unknown_flops = sorted({k.name for k in found.kernels if k.op == "custom-call" and k.flops is None})
    for k in found.kernels:
        k.flops = k.flops or 0.0
    return found


def _walk(module: Module, comp: Computation, times: int, out: Profile) -> None:
    calls = module.computations
    for ins in comp.instructions.values():
        if ins.opcode == "while":
            n = trip_count(module, comp, ins)
            if n is None:
                out.unknown_trips.append(ins.name)
                n = 1
            _walk(module, calls[ins.called("body")[0]], times * n, out)
            _walk(module, calls[ins.called("condition")[0]], times * (n + 1), out)
        elif ins.opcode == "conditional":
            branches = ins.called("branch_computations") or ins.called("true_computation") + ins.called(
                "false_computation")
            options = []
            for branch in branches:
                sub = Profile([], out.unknown_trips, out.conditionals)
                _walk(module, calls[branch], times, sub)
                options.append(sub.kernels)
            out.kernels += max(options, key=lambda ks: (sum((k.flops or 0) * k.launches for k in ks),
                                                        sum(k.bytes * k.launches for k in ks)), default=[])
            out.conditionals.append(ins.name)
        elif ins.opcode in ("call", "async-start"):
            for name in ins.called("to_apply") + ins.called("calls"):
                _walk(module, calls[name], times, out)
        elif ins.opcode not in _NO_KERNEL and _target(ins) not in _NO_KERNEL_CALLS:
            out.kernels.append(_kernel(module, comp, ins, times))


_FLIP = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}


def trip_count(module: Module, caller: Computation, loop: Instruction) -> int | None:
    """How many times a while loop's body runs: XLA's `known_trip_count` (XLA:GPU writes one), else a counter in the
    loop's tuple from a constant, by a constant, compared with a constant (`i < n`, `i <= n`: XLA:TPU); else None."""
    known = loop.backend_config.get("known_trip_count", {}).get("n")
    if known is not None:
        return int(known)
    cond, body = (module.computations[loop.called(key)[0]] for key in ("condition", "body"))
    compare, operands = _op(module, cond, cond.root)
    if compare.opcode != "compare" or len(operands) != 2:
        return None
    counter, limit = operands
    direction = re.search(r"direction=(\w+)", compare.attrs)[1]
    if counter.opcode == "constant":
        counter, limit, direction = limit, counter, _FLIP.get(direction, direction)
    if counter.opcode != "get-tuple-element" or direction not in ("LT", "LE"):
        return None
    index = int(counter.attr("index"))
    start, result = _value(caller, loop.operands[0]), body.instructions[body.root]
    if start.opcode != "tuple" or result.opcode != "tuple":
        return None
    step, parts = _op(module, body, result.operands[index])
    counts = step.opcode == "add" and any(
        p.opcode == "get-tuple-element" and p.attr("index") == str(index) for p in parts)
    by = next((_constant(p) for p in parts if p.opcode == "constant"), None)
    end, first = _constant(limit), _constant(_value(caller, start.operands[index]))
    if not counts or None in (by, end, first) or by <= 0:
        return None
    return max(0, -(-(end - first + (direction == "LE")) // by))


def _op(module: Module, comp: Computation, name: str) -> tuple[Instruction, list[Instruction]]:
    """The instruction behind a value and where its operands come from; a fusion of one op (XLA's `wrapped_add`)
    read as that op, its parameters as the fusion's operands."""
    ins = _value(comp, name)
    if ins.opcode != "fusion":
        return ins, [_value(comp, o) for o in ins.operands]
    fused = module.fused(ins)
    root = _value(fused, fused.root)
    operands = []
    for o in root.operands:
        inner = _value(fused, o)
        outer = inner.opcode == "parameter" and int(inner.args.strip("()")) < len(ins.operands)
        operands.append(_value(comp, ins.operands[int(inner.args.strip("()"))]) if outer else inner)
    return root, operands


def _value(comp: Computation, name: str) -> Instruction:
    return _source(comp, name, ("bitcast", "reshape", "copy", "convert"))


def _constant(ins: Instruction) -> int | None:
    found = re.fullmatch(r"\((-?\d+)\)", ins.args) if ins.opcode == "constant" else None
    return int(found[1]) if found else None


def _target(ins: Instruction) -> str:  # a custom call's target ("" for any other instruction)
    return ins.quoted("custom_call_target") if ins.opcode == "custom-call" else ""


def _kernel(module: Module, comp: Computation, ins: Instruction, times: int) -> Kernel:
    fused = module.fused(ins) if ins.opcode == "fusion" else None
    target = _target(ins)
    if fused is not None:
        kind, custom = ins.attr("kind") or "?", ins.backend_config.get("fusion_backend_config", {}).get("kind")
        kind = f"{kind}:{custom}" if custom else kind
        flops, nbytes = _dot_flops(module, fused), _fusion_bytes(comp, ins, fused)
    elif ins.opcode == "custom-call":  # its byte-typed results are scratch
        kind, flops = target, _custom_call_flops(comp, ins, target)
        nbytes = _operand_bytes(comp, ins) + _nbytes([a for a in ins.results if a.dtype not in ("u8", "s8")])
    else:
        kind, flops, nbytes = ins.opcode, _op_flops(comp, ins), _plain_bytes(comp, ins)
    op_name = ins.quoted("op_name")
    stage = phase(op_name)
    category = _category(module, ins, fused, target, op_name, stage, flops)
    return Kernel(ins.name, ins.opcode, kind, category, stage, scope(op_name), times, flops, nbytes, op_name)


def _operand_bytes(comp: Computation, ins: Instruction) -> float:
    return _nbytes([a for name in ins.operands for a in comp.shape(name)])


def _plain_bytes(comp: Computation, ins: Instruction) -> float:
    if ins.opcode in _SLICES:  # reads the slice only
        return 2 * _nbytes(ins.results)
    if ins.opcode == "dynamic-update-slice":  # in place: reads and writes the update
        return 2 * _nbytes(comp.shape(ins.operands[1]))
    if ins.opcode == "copy-start":
        return 2 * _nbytes(comp.shape(ins.operands[0]))
    return _operand_bytes(comp, ins) + _nbytes(ins.results)


def _through_bitcasts(fused: Computation, name: str) -> list[Instruction]:
    """The users of `name` in a fused computation, looking through bitcasts and reshapes (free views)."""
    users = []
    for user in fused.instructions.values():
        if name in user.operands:
            users += _through_bitcasts(fused, user.name) if user.opcode in ("bitcast", "reshape") else [user]
    return users


def _source(comp: Computation, name: str, through=("bitcast", "reshape")) -> Instruction:
    """The instruction a value comes from, through free views (and `through` ops)."""
    ins = comp.instructions[name]
    while ins.opcode in through and ins.operands:
        ins = comp.instructions[ins.operands[0]]
    return ins


def _fusion_bytes(comp: Computation, ins: Instruction, fused: Computation) -> float:
    """Operands read plus results written by one fused kernel; an operand only sliced (the scan's stacked weights)
    at the slices' size, an output written in place by a `dynamic-update-slice` at the update's (its input unread)."""
    params = {p.name: int(p.args.strip("()")) for p in fused.instructions.values() if p.opcode == "parameter"}
    root = _source(fused, fused.root)
    outputs = [_source(fused, o) for o in root.operands] if root.opcode == "tuple" else [root]
    in_place = {_source(fused, o.operands[0]).name for o in outputs if o.opcode == "dynamic-update-slice"}
    total = 0.0
    for name, index in params.items():
        if index >= len(ins.operands) or name in in_place:
            continue
        full = _nbytes(comp.shape(ins.operands[index]))
        users = _through_bitcasts(fused, name)
        if users and all(u.opcode in _SLICES and _source(fused, u.operands[0]).name == name for u in users):
            total += min(full, _nbytes([a for u in users for a in u.results]))
        else:
            total += full
    for out in outputs:
        if out.opcode == "dynamic-update-slice" and out.operands and \
                _source(fused, out.operands[0]).opcode == "parameter":
            total += _nbytes(fused.shape(out.operands[1]))
        else:
            total += _nbytes(out.results)
    return total


def _gemm_flops(comp: Computation, ins: Instruction, contracting) -> float:
    """2 × the result's size × the product of the lhs's contracting dimensions."""
    lhs = comp.shape(ins.operands[0])[0]
    return 2.0 * ins.results[0].size * math.prod(lhs.dims[int(i)] for i in contracting)


def _op_flops(comp: Computation, ins: Instruction) -> float:
    """Tensor-core FLOPs of one dot or convolution (0 for any other op)."""
    if ins.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        return _gemm_flops(comp, ins, re.findall(r"\d+", contracting[1]) if contracting else [])
    return _convolution_flops(comp, ins) if ins.opcode == "convolution" else 0.0


def _convolution_flops(comp: Computation, ins: Instruction) -> float:
    """2 × batch × output features × input features (per group) × the (output, window) position pairs inside the
    input, per spatial dimension (XLA:TPU's windowed einsums pad half of their windows)."""
    lhs_labels, rhs_labels, out_labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs).groups()
    lhs, rhs, out = comp.shape(ins.operands[0])[0], comp.shape(ins.operands[1])[0], ins.results[0]
    window = dict(re.findall(r"(\w+)=([\d_x]+)", (re.search(r"window=\{([^}]*)\}", ins.attrs) or [None, ""])[1]))
    pairs = 1
    for d, label in enumerate(sorted(c for c in lhs_labels if c.isdigit())):
        field = {k: v.split("x")[d] for k, v in window.items() if k != "rhs_reversal"}
        size, stride = int(field.get("size", 1)), int(field.get("stride", 1))
        low = int(field.get("pad", "0_0").split("_")[0])
        base, dilation = int(field.get("lhs_dilate", 1)), int(field.get("rhs_dilate", 1))
        at = (np.arange(out.dims[out_labels.index(label)])[:, None] * stride
              + np.arange(size)[None, :] * dilation - low)  # positions in the (base-dilated) padded input
        inside = (at >= 0) & (at <= (lhs.dims[lhs_labels.index(label)] - 1) * base) & (at % base == 0)
        pairs *= int(inside.sum())
    return 2.0 * out.dims[out_labels.index("b")] * out.dims[out_labels.index("f")] * rhs.dims[
        rhs_labels.index("i")] * pairs


def _leaves(module: Module, comp: Computation):
    """(computation, instruction) of a fused computation, nested fusions opened."""
    for ins in comp.instructions.values():
        if ins.opcode == "fusion":
            yield from _leaves(module, module.fused(ins))
        else:
            yield comp, ins


def _dot_flops(module: Module, comp: Computation) -> float:  # nested fusions included
    return sum((_op_flops(c, ins) for c, ins in _leaves(module, comp)), 0.0)


def _custom_call_flops(comp: Computation, ins: Instruction, target: str) -> float | None:
    """cuDNN flash attention: forward 2·B·H·T·S·(d + d_v) (halved when causal), backward 2.5× (five products for
    two); else the call's own cost estimate (Mosaic), a cuBLAS gemm's; None for any other (docs/compile.md)."""
    fmha = ins.backend_config.get("cudnn_fmha_backend_config")
    if target.startswith("__cudnn$fmha") and fmha:
        b, h, t, s = (int(x) for x in fmha["intermediate_tensor_shape"]["dimensions"])
        d, dv = comp.shape(ins.operands[0])[0].dims[-1], comp.shape(ins.operands[2])[0].dims[-1]
        forward = 2.0 * b * h * t * s * (d + dv) * (0.5 if "CAUSAL" in fmha.get("mask_type", "") else 1.0)
        return forward * (2.5 if "Backward" in target else 1.0)
    estimate = re.search(r'"cost_estimate"\s*:\s*\{[^}]*"flops"\s*:\s*"?(\d+)', ins.attrs)
    if estimate:
        return float(estimate[1])
    if target in ("__cublas$gemm", "__cublas$lt$matmul"):
        dims = ins.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        return _gemm_flops(comp, ins, dims.get("lhs_contracting_dimensions", []))
    return None


def _parts(op_name: str) -> list[str]:
    """The op_name's scopes without jit(train_step), transformations, loop plumbing and the primitive; `jit(f)` as
    `f()`."""
    parts = op_name.split("/")[1:-1] if op_name.startswith("jit(") else op_name.split("/")[:-1]
    kept = []
    for part in parts:
        if _WRAPPERS.match(part) or part in _PLUMBING:
            continue
        part = re.sub(r"^jit\((.*)\)$", r"\1()", part)
        if not kept or kept[-1] != part:
            kept.append(part)
    return kept


def phase(op_name: str) -> str:
    """forward / recompute (a remat's second forward) / backward / optimizer (after the gradient) / other."""
    if "rematted_computation" in op_name:
        return "recompute"
    if "transpose(jvp" in op_name:
        return "backward"
    if "jvp(" in op_name or any(not p.endswith("()") for p in _parts(op_name)):
        return "forward"  # a module's op outside the differentiated function (constant in the parameters)
    return "optimizer" if op_name else "other"


def scope(op_name: str) -> str:
    """The model's module path an op comes from (under "loss" / "optimizer" outside the model): "jit(train_step)/
    transpose(jvp(DecoderLM))/while/body/closed_call/layers/layers/checkpoint/block/attn/jit(diff_attention)/
    dot_product_attention_bwd" -> "layers/block/attn/diff_attention()"."""
    kept = _parts(op_name)
    if phase(op_name) == "optimizer":
        kept = ["optimizer", *kept]
    elif "jvp()" in op_name:  # the loss function itself (its own ops: the output head, the cross-entropy)
        kept = ["loss", *kept]
    return "/".join(kept) or ("model" if op_name else "(no metadata)")


def _category(module: Module, ins: Instruction, fused: Computation | None, target: str, op_name: str, stage: str,
              flops: float) -> str:
    if ins.opcode in _COLLECTIVES or target == "AsyncCollectiveStart":
        return "collective"
    attention = "attention" in op_name
    if target:
        return "attention" if target.startswith("__cudnn$fmha") or attention else "matmul" if flops else "other"
    if flops:
        return "attention" if attention else "matmul"
    if stage == "optimizer":
        return "optimizer"
    if any(part.endswith("norm") for part in _parts(op_name)):
        return "norm"
    arrays_out = any(a.size > 1 for a in ins.results)  # not a scalar's bookkeeping
    if ins.opcode in _COPIES or (fused is not None and arrays_out and _moves_only(module, fused)):
        return "copy/transpose"
    return "elementwise/fusion"


def _moves_only(module: Module, comp: Computation) -> bool:
    """A fused computation that only moves data (no arithmetic; scalar index maths aside)."""
    return all(ins.opcode in _MOVES or all(a.size <= 1 for a in ins.results) for _, ins in _leaves(module, comp))


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    kind: str  # the device kind, as JAX names it
    flops: float  # dense bf16 FLOP/s
    hbm: float  # bytes/s


def _by_kind(table: dict, kind: str):
    return next((value for name, value in table.items() if name.lower() in kind.lower()), None)


def chip(name: str) -> Chip:
    """A chip by its short name (CHIPS) or device kind; ValueError when its peaks are not known."""
    kind = CHIPS.get(name.lower(), name)
    flops, hbm = _by_kind(PEAK_FLOPS, kind), _by_kind(HBM_BANDWIDTH, kind)
    if flops is None or hbm is None:
        raise ValueError(f"no peak FLOP/s or HBM bandwidth known for {name!r}; known: {', '.join(CHIPS)}")
    return Chip(name, kind, flops, hbm)


def step_time(kernels: list[Kernel], peak: Chip, launch_s: float = 0.0) -> float:
    """Seconds per step: every launch at its roofline time, plus `launch_s` per launch."""
    return sum(k.launches * (k.roofline_s(peak) + launch_s) for k in kernels)


def totals(kernels: list[Kernel], peak: Chip, key) -> dict[str, Counter]:
    """Per group (`key(kernel)`): kernels, launches, FLOPs, bytes, roofline seconds per step and their compute-bound
    part; largest time first."""
    groups = defaultdict(Counter)
    for k in kernels:
        time_s = k.launches * k.roofline_s(peak)
        groups[key(k)].update(kernels=1, launches=k.launches, flops=k.launches * k.flops, bytes=k.launches * k.bytes,
                              time_s=time_s, compute_s=time_s * (k.bound(peak) == "compute"))
    return dict(sorted(groups.items(), key=lambda item: -item[1]["time_s"]))
