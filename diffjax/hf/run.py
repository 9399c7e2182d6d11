"""HF directories to and from diffjax run directories (what `diffjax hf import / export` call; docs/hf.md).

An imported run is an ordinary run directory: config.json and a step-0 checkpoint of the imported params and a fresh
optimizer state. An HF tokenizer.json comes in with the checkpoint (the run keeps a copy) and goes out with an export.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from diffjax import checks, sharding
from diffjax import config as config_lib
from diffjax.config import Config, ConfigError
from diffjax.data.tokenizer import Cl100kTokenizer, HFTokenizer, get_tokenizer
from diffjax.hf.checkpoint import default_mode, load_pretrained, save_pretrained
from diffjax.hf.llama_to_diff import llama_to_diff
from diffjax.model.transformer import SCANNED
from diffjax.train import run_config
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.optim import make_optimizer
from diffjax.train.run_loader import load_run
from diffjax.train.state import TrainState, state_shardings

TOKENIZER_NOTE = "tokenizer.md"
# An import's settings before its --set: a pretrained model fine-tunes with transformers' Trainer's recipe (its
# run_clm defaults: peak lr 5e-5 decayed linearly to 0, no weight decay, 8 sequences a step) and a 3 % warm-up of
# the default 1000 steps for Adam's fresh moments, not with diffjax's from-scratch defaults (docs/hf.md).
FINE_TUNING = ("optim.lr=5e-5", "optim.final_lr=0", "optim.warmup_steps=30", "optim.weight_decay=0",
               "data.batch_size=8")
# The run's settings beside the weights: an export -> import round trip evaluates on the same data and recipe.
RUN_SETTINGS, RUN_SECTIONS = "diffjax_run.json", ("data", "optim", "train")


def export_run(workdir, out, step: int | None = None) -> Path:
    """Write run `workdir`'s params (latest checkpoint, or `step`) as an HF directory `out` (new, or empty): written
    into a temporary directory beside it and renamed when complete, so a failed export leaves no `out`."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty directory; export into a new one")
    cfg, params, _ = load_run(workdir, step=step, params_only=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        tmp.chmod(default_mode(0o777))  # mkdtemp's is 0700: the export's directory follows the umask, as its files
        save_pretrained(cfg.model, params, tmp, tokenizer=cfg.data.tokenizer)
        del params
        _write_tokenizer(cfg, tmp, out)
        settings = {k: v for k, v in json.loads(cfg.to_json()).items() if k in RUN_SECTIONS}
        (tmp / RUN_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
        tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # our own partial files: nothing that looks like an export stays
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):  # storage refused: say what was kept
            raise OSError(e.errno, f"the export stopped ({e.strerror or e}); nothing was written", str(out)) from e
        raise
    return out


def _write_tokenizer(cfg: Config, into: Path, out: Path) -> None:
    """Into `into` (the export `out`, being written): an HF tokenizer's files, as the run holds them; else a note
    (byte), or a recipe that makes one in `out` (cl100k)."""
    tok = get_tokenizer(cfg.data.tokenizer)
    if isinstance(tok, HFTokenizer):
        for file in tok.files:
            shutil.copyfile(file, into / file.name)
        return
    if cfg.data.tokenizer == "byte":
        text = ("This model was trained on diffjax's byte tokenizer (ids 0-255 = UTF-8 bytes, 256 = end of document, "
                "257 = padding; diffjax/data/tokenizer.py); it has no Hugging Face tokenizer. Feed it byte ids.\n")
    else:
        text = CL100K_NOTE.format(out=out, eos=Cl100kTokenizer.eos_id, vocab=cfg.model.vocab_size)
    (into / TOKENIZER_NOTE).write_text(text)


# Checked by tests/test_hf_cli.py (run as written, transformers 5.23): AutoTokenizer then gives diffjax's ids.
# convert_tiktoken_to_fast alone numbers tiktoken's special tokens from 100256 on (<|endoftext|> would be 100256).
CL100K_NOTE = """This model uses tiktoken's cl100k_base encoding (diffjax/data/tokenizer.py): <|endoftext|> = {eos} ends
every document; the embedding has {vocab} rows (the ids past tiktoken's are padding, never produced). No
tokenizer.json is written. This makes one here that `transformers.AutoTokenizer.from_pretrained` loads with the
same ids (needs `pip install transformers tiktoken blobfile`; tiktoken downloads the encoding once):

```python
import json

import tiktoken
from transformers import PreTrainedTokenizerFast
from transformers.integrations.tiktoken import convert_tiktoken_to_fast

out = "{out}"
enc = tiktoken.get_encoding("cl100k_base")
convert_tiktoken_to_fast(enc, out)  # tokenizer.json, but its special tokens numbered from 100256 on
spec = json.load(open(f"{{out}}/tokenizer.json"))
for token in spec["added_tokens"]:  # give them tiktoken's ids
    token["id"] = spec["model"]["vocab"][token["content"]] = enc._special_tokens[token["content"]]
json.dump(spec, open(f"{{out}}/tokenizer.json", "w"))
PreTrainedTokenizerFast(tokenizer_file=f"{{out}}/tokenizer.json", eos_token="<|endoftext|>").save_pretrained(out)
```

Ordinary text then gets diffjax's ids; the text "<|endoftext|>" becomes the special token there (diffjax's
tokenizer encodes it as plain text).
"""


def _fresh_opt_state(tx, params, shardings):
    """`tx.init(params)` without a copy of the moments per parameter: its numbers (counts, hyper-parameters) from an
    init on empty stand-ins, and every moment (Adam's, all zeros at init) one zeros array per shape, shared."""
    numbers = tx.init(jax.tree.map(lambda x: np.zeros((0,) * x.ndim, x.dtype), params))
    zeros = {}

    def fill(shape, number, where):
        if number.shape == shape.shape:
            return jax.device_put(number, where)
        key = (shape.shape, shape.dtype, where)
        return zeros.setdefault(key, jax.numpy.zeros(shape.shape, shape.dtype, device=where))

    return jax.tree.map(fill, jax.eval_shape(tx.init, params), numbers, shardings)


def import_run(hf_dir, workdir, overrides=(), *, as_arch: str | None = None, start: str = "exact", model_cfg=None,
               params=None) -> Config:
    """Make run directory `workdir` from an HF directory (or from given `model_cfg`, `params`, which it consumes):
    `overrides` (`section.field=value`, not the model.* fields the checkpoint fixes) apply over its
    diffjax_run.json's settings, and `as_arch="diff"` converts a Llama (`llama_to_diff` from `start`, new parameters
    drawn from `train.seed`). The checkpoint holds the params as read and Adam's zero moments: no random model."""
    if params is None:
        model_cfg, params = load_pretrained(hf_dir)
    cfg = dataclasses.replace(Config(), model=model_cfg, name=Path(workdir).name)
    for assignment in FINE_TUNING:
        cfg = config_lib.override(cfg, assignment)
    settings = Path(hf_dir) / RUN_SETTINGS if hf_dir is not None else None
    if settings is not None and settings.is_file():  # a diffjax export: its run's data, optimizer and schedule
        exported = config_lib.from_dict(json.loads(settings.read_text()))
        cfg = dataclasses.replace(cfg, **{k: getattr(exported, k) for k in RUN_SECTIONS})
    if hf_dir is not None and (Path(hf_dir) / "tokenizer.json").is_file():  # the checkpoint's own tokenizer
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(hf_dir)))
    for assignment in overrides:
        cfg = config_lib.override(cfg, assignment)
    held = dataclasses.replace(model_cfg, scan_layers=cfg.model.scan_layers)  # stacked below, as the run asks
    fixed = run_config.fixed_changes(dataclasses.replace(cfg, model=held), cfg, was="in the checkpoint",
                                     at_step_0=True)  # what a resume may not change, but for seeds and init
    if fixed:
        raise ConfigError("--set " + "; --set ".join(fixed))
    if cfg.model.dtype == "float16":
        raise ConfigError("--set model.dtype=float16: diffjax has no loss scaling, so float16 gradients underflow; "
                          "an import computes in bfloat16 (float32's range; a float16 checkpoint's default) or float32")
    if as_arch not in (None, model_cfg.arch):
        if as_arch != "diff":
            raise ConfigError(f"--as {as_arch}: a checkpoint converts only from a Llama to diff")
        converted, params = llama_to_diff(cfg.model, params, seed=cfg.train.seed, start=start)
        cfg = dataclasses.replace(cfg, model=converted)
    elif start != "exact":
        raise ConfigError(f"--start {start}: a start of a conversion (--as diff)")
    cfg = checks.check(cfg, data=False)  # an import reads no data: its settings are checked where data is read
    workdir = Path(workdir)
    if (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
        raise ConfigError(f"{workdir} already holds checkpoints; import into a new --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract, shardings = state_shardings(cfg, sharding.make_mesh(cfg.mesh), tx)
    if cfg.model.scan_layers:  # imported params are unrolled: stacked on the layer axis on the host, a leaf at a time
        layers = [jax.tree.flatten(params.pop(f"layer_{i}")) for i in range(cfg.model.n_layers)]
        stacked = []
        for j in range(len(layers[0][0])):
            stacked.append(np.stack([leaves[j] for leaves, _ in layers]))
            for leaves, _ in layers:
                leaves[j] = None
        params[SCANNED] = {"block": layers[0][1].unflatten(stacked)}
        del layers, stacked
    leaves, treedef = jax.tree.flatten(params)
    if treedef != jax.tree.structure(abstract.params):
        raise ConfigError(f"{hf_dir}: the imported parameters do not have the model's structure")
    del params
    for j, where in enumerate(jax.tree.leaves(shardings.params)):  # onto the devices, each host copy dropped
        leaves[j] = jax.device_put(leaves[j], where)
    params = treedef.unflatten(leaves)
    del leaves
    step, rng = (jax.device_put(x, sharding.replicated(sharding.mesh_of(params)))
                 for x in (np.zeros((), np.int32), jax.random.split(jax.random.PRNGKey(cfg.train.seed))[1]))
    state = TrainState(step=step, params=params, opt_state=_fresh_opt_state(tx, params, shardings.opt_state), rng=rng,
                       nonfinite_run=step, nonfinite_total=step)  # as init_state makes them
    run_config.write(workdir, cfg)
    ckpt = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints, async_save=False)
    ckpt.save(0, state, None)  # no data position: training starts the data from its beginning
    ckpt.close()
    stored = json.loads((Path(hf_dir) / "config.json").read_text()) if hf_dir is not None else {}
    origin = {"hf_dir": str(hf_dir), "dtype": stored.get("dtype") or stored.get("torch_dtype")}
    if cfg.model.arch != model_cfg.arch:
        origin |= {"converted_to": cfg.model.arch, "start": start}
    (workdir / "imported_from.json").write_text(json.dumps(origin) + "\n")
    return cfg
