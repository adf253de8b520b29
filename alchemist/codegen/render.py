"""Render a ModelIR into a formatted, deterministic Python module.

Metadata reaches the generated code only through the `py` filter (a Python literal made with `repr`
from a str/int/float/bool/None or a tuple of those) or as a validated identifier; the template is
rendered with StrictUndefined, formatted with black and parsed back with libcst before it is returned.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import black
import jinja2
import libcst

from alchemist import __version__
from alchemist.errors import UnsupportedModelError
from alchemist.ir import ModelIR

# An installed wheel ships the templates as alchemist/templates (see setup.py); a source checkout (editable
# install) keeps the one copy in the top-level templates/ folder.
TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
if not TEMPLATES_DIR.is_dir():
    TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
BLACK_MODE = black.Mode(line_length=120, target_versions={black.TargetVersion.PY312})


def py_literal(value) -> str:
    """The one way a value from the GGUF file becomes source text: a repr of plain data."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsupportedModelError(f"refusing to emit non-finite number {value!r} into generated code")
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [py_literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    raise TypeError(f"py_literal: refusing to emit a {type(value).__name__}")


def module_slug(source_file: str) -> str:
    """A safe module name from the GGUF file name: 'gemma-3-270m-q4_k_m.gguf' -> 'gemma_3_270m_q4_k_m'."""
    stem = source_file[:-5] if source_file.lower().endswith(".gguf") else source_file
    slug = re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_")[:64] or "model"
    if not slug[0].isalpha():
        slug = "model_" + slug
    return slug


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    return env


def module_constants(ir: ModelIR) -> dict:
    """The configuration constants a generated module defines, name -> value, each exactly as the IR says.

    The template renders them and the auditor compares a module's literals against them: one mapping."""
    first = ir.layers[0]
    att, mlp = first.attention, first.mlp
    constants = {
        "ARCHITECTURE": ir.architecture,
        "N_VOCAB": ir.n_vocab,
        "N_EMBD": ir.n_embd,
        "N_LAYER": ir.n_layer,
        "N_HEAD": att.n_head,
        "N_KV_HEAD": att.n_kv_head,
        "HEAD_DIM": att.head_dim,
        "N_FF": mlp.n_ff,
        "CONTEXT_LENGTH": ir.n_ctx_train,
        "RMS_EPS": ir.rms_eps,
        "ROPE_DIM": att.rope_dim,
        "SCORE_SCALE": att.score_scale,
        "SLIDING_WINDOW": tuple(lay.attention.sliding_window for lay in ir.layers),
        "ROPE_BASE": tuple(lay.attention.rope_base for lay in ir.layers),
        "ROPE_FREQ_SCALE": tuple(lay.attention.rope_freq_scale for lay in ir.layers),
        "DATA_OFFSET": ir.data_offset,
    }
    if ir.embedding_scale != 1.0:
        constants["EMBED_SCALE"] = ir.embedding_scale
    if ir.final_logit_softcap:
        constants["FINAL_LOGIT_SOFTCAP"] = ir.final_logit_softcap
    return constants


def template_context(ir: ModelIR) -> dict:
    if not IDENTIFIER.match(ir.architecture):
        raise UnsupportedModelError(f"architecture name {ir.architecture!r} is not a valid identifier")
    if not ir.uniform_layers:
        raise UnsupportedModelError(
            f"{ir.source_file}: layers with different head counts or MLP sizes are not supported"
        )
    first = ir.layers[0]
    att, mlp = first.attention, first.mlp
    for lay in ir.layers:
        if (lay.attention.qkv_bias, lay.attention.out_bias, lay.mlp.bias) != (att.qkv_bias, att.out_bias, mlp.bias):
            raise UnsupportedModelError(f"{ir.source_file}: biases present in some layers only are not supported")
        if lay.attention.score_scale != att.score_scale or lay.attention.rope_dim != att.rope_dim:
            raise UnsupportedModelError(f"{ir.source_file}: per-layer attention scale / rope size is not supported")
    return dict(
        arch=ir.architecture,
        model_name=ir.model_name,
        source_file=ir.source_file,
        source_sha256=ir.source_sha256,
        file_size=ir.file_size,
        data_offset=ir.data_offset,
        generator=f"alchemist {__version__}",
        ir_hash=ir.ir_hash(),
        n_vocab=ir.n_vocab,
        n_embd=ir.n_embd,
        n_layer=ir.n_layer,
        n_head=att.n_head,
        n_kv_head=att.n_kv_head,
        head_dim=att.head_dim,
        n_ff=mlp.n_ff,
        n_ctx_train=ir.n_ctx_train,
        rms_eps=ir.rms_eps,
        rope_dim=att.rope_dim,
        rope_style=ir.rope_style.value,
        score_scale=att.score_scale,
        embedding_scale=ir.embedding_scale,
        final_logit_softcap=ir.final_logit_softcap,
        sliding_window=tuple(lay.attention.sliding_window for lay in ir.layers),
        rope_base=tuple(lay.attention.rope_base for lay in ir.layers),
        rope_freq_scale=tuple(lay.attention.rope_freq_scale for lay in ir.layers),
        has_rope_freqs=ir.has_rope_freqs,
        tensors=ir.tensors,
        qkv_bias=att.qkv_bias,
        out_bias=att.out_bias,
        mlp_bias=mlp.bias,
        qk_norm=att.q_norm,
        sandwich_norms=first.post_attention_norm,
        activation=mlp.activation.value,
        act_fn="gelu" if mlp.activation.value == "gelu_tanh" else "silu",
        tied_output=ir.tied_output,
    )


def render_module(ir: ModelIR) -> str:
    """Source text of the generated module for `ir`: rendered, black-formatted, libcst-parseable."""
    return _format(_environment().get_template("model.py.j2").render(**template_context(ir)))


def _format(raw: str) -> str:
    """black-format `raw` and check that libcst parses it; remembered on disk by the raw text's sha256
    (black and libcst take 0.5 s for a model module, on every load_llm otherwise)."""
    from alchemist.paths import cache_subdir, remember

    key = hashlib.sha256(f"{black.__version__}\0{BLACK_MODE}\0{raw}".encode()).hexdigest()
    memo = cache_subdir("formatted") / f"{key}.py"
    try:
        return memo.read_text()
    except OSError:
        pass
    source = black.format_str(raw, mode=BLACK_MODE)
    libcst.parse_module(source)  # raises on anything that is not valid Python
    remember(memo, source)
    return source
