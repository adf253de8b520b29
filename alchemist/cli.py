"""The `alchemist` command line. Errors in the input are reported in one line and exit with status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from alchemist.errors import AlchemistError


def _cmd_inspect(args) -> int:
    from alchemist.arch import build_model_ir
    from alchemist.reading import read_model

    facts = read_model(args.model)
    ir = build_model_ir(facts)
    if args.ir:
        print(ir.to_json())
        return 0
    types: dict[str, int] = {}
    for t in ir.tensors:
        types[t.ggml_type] = types.get(t.ggml_type, 0) + 1
    lines = [
        f"file          {facts.file_name}  ({facts.file_size / 1e6:.1f} MB, "
        + (
            f"a snapshot of {len(ir.source_files)} safetensors files)" if ir.source_files else f"GGUF v{facts.version})"
        ),
        f"model         {ir.model_name!r}",
        f"architecture  {ir.architecture}   (computation {ir.computation_hash()[:12]}: a GGUF and its snapshot share it)",
        *describe_components(ir),
        f"tensors       {len(ir.tensors)}: " + ", ".join(f"{k}×{v}" for k, v in sorted(types.items())),
        *_kernel_line(ir),
        f"ir sha256     {ir.ir_hash()}",
    ]
    print("\n".join(lines))
    return 0


def _kernel_line(ir) -> list[str]:
    """The file's quantized types, which alchemist's kernels multiply in their blocks (build_ir refuses any other)."""
    quantized = sorted({t.ggml_type for t in ir.tensors if t.quantized and t.ggml_type not in ("F16", "BF16")})
    return [f"kernels       {', '.join(quantized)} multiplied in their GGUF blocks"] if quantized else []


def describe_components(ir) -> list[str]:
    """One line per component kind of the IR (what `alchemist inspect` prints)."""
    lay = ir.layers[0]

    def norm(spec) -> str:
        return "none" if spec is None else f"{spec.kind.value}{'+bias' if spec.bias else ''}"

    convs = [x.index for x in ir.layers if x.conv is not None]
    return [
        *(
            [f"short conv    layers {convs}: length {ir.layers[convs[0]].conv.kernel}, gated (B·X in, C· out)"]
            if convs
            else []
        ),
        *_recurrent_lines(ir),
        *_latent_lines(ir),
        f"layers        {ir.n_layer}   d_model {ir.n_embd}   {lay.wiring.value} block, norms: attn {norm(lay.attn_norm)}, "
        f"ffn {norm(lay.ffn_norm)}, post {norm(lay.attn_post_norm)}/{norm(lay.ffn_post_norm)}"
        + (f", residual x{lay.residual_scale:g}" if lay.residual_scale != 1.0 else ""),
        *_attention_lines(ir, norm)[0],
        *_mlp_lines(ir),
        *_attention_lines(ir, norm)[1],
        f"embedding     scale {ir.embedding.scale:g}" + (", learned positions" if ir.embedding.positions else ""),
        f"vocabulary    {ir.n_vocab}   context {ir.n_ctx_train}   output "
        f"{'tied to token_embd' if ir.output.tied else ir.output.weight}"
        + (f", logit scale {ir.output.logit_scale:g}" if ir.output.logit_scale != 1.0 else "")
        + (f", softcap {ir.output.final_softcap:g}" if ir.output.final_softcap else ""),
    ]


def _attention_lines(ir, norm) -> tuple[list[str], list[str]]:
    """(attention: heads per geometry, scale, extras; RoPE, windows and how layers share caches and inputs), one
    line where no layer attends."""
    if not ir.attention_layers:
        return ["attention     none: every layer mixes tokens otherwise"], []
    att = ir.attention_layers[0].attention
    rope = att.rope
    extras = [
        "fused qkv" if att.qkv else "",
        "qkv bias" if (att.q_bias or att.qkv_bias) else "",
        "out bias" if att.out_bias else "",
        f"q/k {norm(att.q_norm)} norm per {att.qk_norm_scope.value}" if att.q_norm else "",
        f"softcap {att.logit_softcap:g}" if att.logit_softcap else "",
    ]
    rotating = [x.attention.rope.style.value != "none" for x in ir.attention_layers]
    windows = sorted({x.attention.sliding_window for x in ir.attention_layers})
    # one line per head geometry where layers differ in it (gemma4's sliding and global layers)
    sizes = {}
    for x in ir.attention_layers:
        a = x.attention
        sizes.setdefault((a.n_head, a.n_kv_head, a.head_dim, a.rope.dim, a.rope.scaling.value), []).append(x.index)
    heads = [
        f"{n} query heads, {kv} KV heads, head size {d}" + (f" (layers {where})" if len(sizes) > 1 else "")
        for (n, kv, d, _, _), where in sizes.items()
    ]
    ropes = "; ".join(
        f"dims {dims}, scaling {scaling}" + (f" (layers {where})" if len(sizes) > 1 else "")
        for (_, _, _, dims, scaling), where in sizes.items()
    )
    shared = {x.index: x.attention.kv_layer for x in ir.attention_layers if x.attention.kv_layer not in (None, x.index)}
    first = ir.layers[0]
    from_keys = [x.index for x in ir.attention_layers if x.attention.q and x.attention.v is None]
    extra = (
        (
            [f"kv sharing    layers {list(shared)} attend to the caches of layers {list(shared.values())}"]
            if shared
            else []
        )
        + ([f"values        layers {from_keys} take their keys' projection (no attn_v)"] if from_keys else [])
        + (
            [f"per-layer     inputs of {ir.per_layer_input.width} per layer, added after the MLP through a gate"]
            if first.per_layer_gate
            else []
        )
        + (["out scale     each layer's output times its layer_output_scale"] if first.out_scale else [])
    )
    return [
        f"attention     {heads[0]}, scale {att.score_scale:.6g}" + "".join(f", {e}" for e in extras if e),
        *(f"              {h}" for h in heads[1:]),
    ], [
        f"rope          {rope.style.value if all(rotating) or not any(rotating) else f'{sum(rotating)} of {ir.n_layer} layers'}, "
        f"{ropes}, bases {sorted({x.attention.rope.base for x in ir.attention_layers})}",
        f"windows       {windows} (0 = global)"
        + "".join(f", chunks of {c}" for c in sorted({x.attention.chunk for x in ir.attention_layers} - {0}))
        + (", temperature-tuned queries" if att.temperature else "")
        + (", q/k rms-normed after RoPE" if att.rotated_qk_norm else "")
        + (", output gated per head" if att.output_gate else ""),
        *extra,
    ]


def _recurrent_lines(ir) -> list[str]:
    """The recurrent token mixers (Mamba-2, gated delta-net): where, their sizes, and their state per sequence."""
    lines = []
    ssm = [x.index for x in ir.layers if x.ssm is not None]
    if ssm:
        s = ir.layers[ssm[0]].ssm
        state = (s.n_head * s.head_dim * s.n_state + (s.conv_kernel - 1) * s.n_xbc) * 4
        lines.append(
            f"mamba-2       layers {ssm}: {s.n_head} heads of {s.head_dim}, state {s.n_state}, {s.n_group} groups, "
            f"conv {s.conv_kernel}; {state / 2**10:.0f} KiB of state per layer and sequence"
        )
    delta = [x.index for x in ir.layers if x.deltanet is not None]
    if delta:
        d = ir.layers[delta[0]].deltanet
        state = (d.n_v_head * d.head_dim**2 + (d.conv_kernel - 1) * d.n_qkv) * 4
        mapping = "tiled" if d.k_heads_tiled else "interleaved"
        lines.append(
            f"delta-net     layers {delta}: {d.n_v_head} v heads ({d.n_k_head} k heads, {mapping}) of {d.head_dim}, "
            f"conv {d.conv_kernel}; {state / 2**10:.0f} KiB of state per layer and sequence"
        )
    return lines


def _latent_lines(ir) -> list[str]:
    """Multi-head latent attention: how queries, keys and values reach the one cached row, and its size."""
    att = ir.attention_layers[0].attention if ir.attention_layers else None
    lat = att.latent if att is not None else None
    if lat is None:
        return []
    queries = "attn_q" if lat.q else f"low rank {ir.tensor('blk.0.' + lat.q_a).shape[0]} (attn_q_a, norm, attn_q_b)"
    row = att.head_dim * 4 * len(ir.kv_cache_layers)
    return [
        f"latent attn   queries by {queries}, per head {lat.head_dim_nope} + {att.rope.dim} RoPE dims; keys and "
        f"values from one row of {lat.kv_lora_rank} latent + {att.rope.dim} RoPE dims per position "
        f"({row / 2**10:.1f} KiB per position, all layers); heads through attn_k_b, values of {lat.head_dim_v} "
        "through attn_v_b"
    ]


def _mlp_lines(ir) -> list[str]:
    """The FFN of each kind of layer: dense, mixture of experts (router, shared expert), or both."""
    lines = []
    kinds = list(dict.fromkeys(lay.mlp for lay in ir.layers if lay.mlp is not None))
    for mlp in kinds:
        where = ""
        if len(kinds) > 1:
            where = f" (layers {[lay.index for lay in ir.layers if lay.mlp == mlp]})"
        line = f"{mlp.kind.value}, {mlp.activation.value}, ffn {mlp.n_ff}" + (", biases" if mlp.up_bias else "")
        r = mlp.router
        if r:
            line += f", {r.n_expert} experts, top-{r.n_expert_used} by {r.gating.value}"
            line += ", selection bias" if r.selection_bias else ""
            line += f", within the best {r.n_group_used} of {r.n_group} groups" if r.n_group else ""
            line += ", weights renormalized" if r.normalize else ""
            line += f" x{r.weight_scale:g}" if r.weight_scale != 1.0 else ""
            line += ", weighting the expert's input" if r.weight_inputs else ""
            line += f", shared expert ffn {mlp.shared.n_ff}" if mlp.shared else ""
            line += " (gated)" if mlp.shared_gate else ""
        lines.append(f"{'mlp' if not lines else '':14}{line}{where}")
    if ir.unapplied_blocks:
        lines.append(f"{'':14}multi-token-prediction layers {list(ir.unapplied_blocks)}: loaded, not applied")
    return lines


def _cmd_gen(args) -> int:
    from alchemist.arch import build_model_ir
    from alchemist.reading import read_model
    from alchemist.runtime.api import write_generated

    ir = build_model_ir(read_model(args.model))
    target = write_generated(ir, args.output)
    print(f"wrote {target}")
    if not args.no_audit:
        try:
            from alchemist.audit import audit_module, write_reports
        except ImportError:
            print("audit: alchemist.audit is not available; skipped", file=sys.stderr)
            return 0
        report = audit_module(target, gguf_path=args.model)
        paths = write_reports(report, args.audit_dir)
        print(report.table())
        print("audit reports: " + ", ".join(str(p) for p in paths))
        if not report.passed:
            print("audit FAILED: the generated module breaks a contract (see above)", file=sys.stderr)
            return 1
    return 0


def _cmd_run(args) -> int:
    from alchemist import inference, load_llm

    from alchemist.harness.oracle_build import numerics_line
    from alchemist.runtime.api import precompile

    numerics = _numerics(args)
    if args.devices > 1:
        _devices_setup(args)
    model = load_llm(
        args.model,
        backend=args.backend,
        context=args.context,
        compile_now=False,
        numerics=numerics,
        devices=args.devices,
        split=args.split,
    )
    if args.devices > 1:
        _print_device_memory(model)
    if args.tokens:
        prompt = [int(t) for t in args.tokens.split(",")]
    else:
        prompt = args.prompt
    precompile(model, prompt, chat=args.chat)  # the prompt's prefill and decode together (progress bars)
    result = inference(
        model,
        input=prompt,
        max_tokens=args.max_tokens,
        chat=args.chat,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
        stop=args.stop,
        stream=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
    )
    if result.output is None:
        print(" ".join(map(str, result.output_token_ids)))
    else:
        print()
    r = result.report
    t = r["timings"]
    print("\n" + numerics_line(numerics), file=sys.stderr)
    print(
        f"[{r['backend']}] prompt {r['prompt_tokens']} tok, prefill {t['prefill_tok_per_s']} tok/s | "
        f"generated {r['generated_tokens']} tok, decode {t['decode_tok_per_s']} tok/s | "
        f"compile {t['compile_s_total']} s ({r['compilations']['total']} functions, "
        f"{r['compilations']['during_decode']} during decode) | load {t['load_s']} s, "
        f"first token {t['load_s'] + t['first_token_s']:.2f} s after opening | "
        f"peak RSS {r['memory']['peak_rss_mb']:.0f} MB | stop: {r['stop_reason']}",
        file=sys.stderr,
    )
    if args.report:
        Path(args.report).write_text(json.dumps(r, indent=2))
    return 0


def _devices_setup(args) -> None:
    """--devices N: the jax backend, and with --coordinator this process's place in a multi-process run (before
    JAX starts)."""
    if args.backend != "jax":
        raise AlchemistError(f"--devices {args.devices} runs on --backend jax (got --backend {args.backend})")
    if args.coordinator:
        from alchemist.runtime import sharding

        if args.devices % args.num_processes:
            raise AlchemistError(f"--devices {args.devices} does not divide over {args.num_processes} processes")
        local = args.devices // args.num_processes
        sharding.init_distributed(args.coordinator, args.num_processes, args.process_id, local)


def _print_device_memory(model) -> None:
    from alchemist.runtime import sharding

    print(model.engine.placement.layout.describe(model.ir), file=sys.stderr)
    held = sharding.device_memory(model.engine)
    print(
        "per device (weights + KV cache): " + ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in held.items()),
        file=sys.stderr,
    )


def _cmd_fixture(args) -> int:
    from alchemist.fixtures import FIXTURES, write_fixture

    if args.arch not in FIXTURES:
        raise AlchemistError(f"--arch {args.arch!r}: no such fixture (choose from {', '.join(FIXTURES)})")

    if args.quant in ("F32", "F16"):
        write_fixture(args.output, args.arch, weight_type=args.quant)
    else:
        try:
            from alchemist.harness.quantize import quantize_fixture
        except ImportError as e:
            raise AlchemistError(f"quantized fixtures need llama-cpp-python (pip install 'alchemist[oracle]'): {e}")
        tmp = Path(str(args.output) + ".f32.tmp")
        write_fixture(tmp, args.arch, weight_type="F32")
        try:
            quantize_fixture(tmp, args.output, args.quant)
        finally:
            tmp.unlink(missing_ok=True)
    print(f"wrote {args.output}")
    return 0


def _cmd_families(args) -> int:
    from alchemist.fixtures import FIXTURES

    if not args.validate:
        from alchemist.arch import build_model_ir
        from alchemist.fixtures import write_fixture
        from alchemist.gguf_io import read_gguf
        from alchemist.harness.families import quirks
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for case in FIXTURES:
                ir = build_model_ir(read_gguf(write_fixture(Path(tmp) / "f.gguf", case)))
                print(f"{case:20} {', '.join(quirks(ir))}")
        return 0
    from alchemist.harness.families import merge_results, validate_families, write_results
    from alchemist.runtime.backends import BACKENDS

    cases = args.cases.split(",") if args.cases else list(FIXTURES)
    unknown = [c for c in cases if c not in FIXTURES]
    if unknown:
        raise AlchemistError(f"--cases: no such fixture {unknown} (choose from {', '.join(FIXTURES)})")
    backends = list(BACKENDS) if args.backend == "all" else args.backend.split(",")
    rows = validate_families(cases, backends, args.types.split(","), args.workdir, n_generate=args.generate)
    n_failed = sum(1 for r in rows if "passed" in r and not r["passed"])
    n_passed = len(rows) - len(cases) - n_failed
    output = Path(args.output)
    if args.cases and output.exists():
        rows = merge_results(json.loads(output.read_text()), rows, FIXTURES)
    write_results(rows, output, Path(args.table) if args.table else None)
    print(f"{n_passed} passed, {n_failed} failed; results: {args.output}")
    return 0 if n_failed == 0 else 1


def _prompt_ids(args) -> list[int]:
    if getattr(args, "tokens", None):
        return [int(t) for t in args.tokens.split(",")]
    from alchemist.harness.validate import prompt_ids_for

    return prompt_ids_for(args.model, args.prompt)


def _cmd_validate(args) -> int:
    from alchemist.codegen import module_slug
    from alchemist.harness.validate import validate_model, write_validation
    from alchemist.runtime.backends import BACKENDS

    backends = list(BACKENDS) if args.backend == "all" else args.backend.split(",")
    report = validate_model(
        args.model,
        backends,
        prompt=_prompt_ids(args),
        n_generate=args.generate,
        context=args.context,
        numerics=_numerics(args),
        oracle=args.oracle,
        gguf=args.gguf,
        devices=args.devices,
    )
    stem = module_slug(Path(args.model).name) + _numerics_suffix(report["numerics"])
    paths = write_validation(report, args.output, stem)
    print(
        f"validation {'PASSED' if report['passed'] else 'FAILED'} (numerics {report['numerics']}); reports: "
        + ", ".join(map(str, paths))
    )
    return 0 if report["passed"] else 1


def _cmd_diff(args) -> int:
    from alchemist.codegen import module_slug
    from alchemist.harness.validate import diff_model, write_diff

    result = diff_model(
        args.model,
        args.backend,
        _prompt_ids(args),
        tol=args.tol,
        numerics=_numerics(args),
        fed="ops" if args.fed_ops else args.fed,
        fed_tol=args.fed_tol,
    )
    if result.get("fed"):
        from alchemist.harness.fed import print_fed

        print_fed(result)
    else:
        print(f"{'tensor':28} {'NMSE vs llama.cpp':>18}")
        for name, value in result["rows"]:
            mark = "  <-- first divergence" if name == result["first_divergence"] else ""
            print(f"{name:28} {value:18.3e}{mark}")
    stem = f"{module_slug(Path(args.model).name)}_diff_{args.backend}" + _numerics_suffix(result["numerics"])
    stem += "_fed" if result.get("fed") else ""
    paths = write_diff(result, args.output, stem)
    if result.get("chart_error"):
        print(f"chart not drawn: {result['chart_error']}")
    if result["first_divergence"]:
        print(f"first divergent tensor: {result['first_divergence']} (tolerance {result['tolerance']:.1e})")
    else:
        print(f"no tensor exceeds NMSE {result['tolerance']:.1e}")
    fed = result.get("fed")
    if fed:
        print(
            f"fed: first tap over NMSE {fed['tolerance']:.1e}: {fed['first_divergence']}"
            if fed["first_divergence"]
            else f"fed: every layer within NMSE {fed['tolerance']:.1e}"
        )
    print("reports: " + ", ".join(map(str, paths)))
    return 1 if result["first_divergence"] or (fed and fed["first_divergence"]) else 0


def _cmd_explain(args) -> int:
    from alchemist import load_llm
    from alchemist.explain import draw, saliency

    model = load_llm(args.model, backend=args.backend, context=args.context, compile_now=False)
    prompt = [int(t) for t in args.prompt_tokens.split(",")] if args.prompt_tokens else args.prompt
    target = [int(t) for t in args.target_tokens.split(",")] if args.target_tokens else args.target
    if prompt is None or target is None:
        raise AlchemistError(
            "explain needs a prompt (--prompt or --prompt-tokens) and a target (--target or --target-tokens)"
        )
    print("building and compiling log p(target | prompt) and its gradient ...", file=sys.stderr, flush=True)
    result = saliency(model, target, prompt)
    print(result.table())
    if args.output:
        print(f"wrote {draw(result, args.output, title=f'{model.ir.model_name} [{model.backend}]')}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2))
    return 0


def _cmd_tokenize(args) -> int:
    from alchemist.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    ids = tok.encode(args.text, add_special_tokens=not args.no_special)
    for i in ids:
        print(f"{i:>8}  {tok.decode([i])!r}")
    print(f"{len(ids)} tokens: {ids}")
    return 0


def _cmd_chat(args) -> int:
    from alchemist.chat import run_chat
    from alchemist.runtime.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.repeat_penalty, args.seed)
    numerics = _numerics(args)
    return run_chat(
        args.model, args.backend, args.context, args.system, args.max_tokens, params, args.chunk, numerics=numerics
    )


def _cmd_serve(args) -> int:
    from alchemist.serve.cli import run_serve

    return run_serve(args)


def _cmd_graph(args) -> int:
    from alchemist.views.layer_graph import run_graph

    print(
        run_graph(
            args.model,
            args.layer,
            rewrites=args.rewrites,
            backend=args.backend,
            fmt=args.format,
            output=args.output,
            n_tokens=args.tokens,
            capacity=args.capacity,
        )
    )
    return 0


def _cmd_card(args) -> int:
    from alchemist.views.card import run_card

    print(run_card(args.models, args.output))
    return 0


def _cmd_perplexity(args) -> int:
    from alchemist.perplexity import perplexity_file

    result = perplexity_file(
        args.model,
        args.file,
        context=args.context,
        stride=args.stride,
        backend=args.backend,
        oracle=args.oracle,
        numerics=_numerics(args),
    )
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
        print(f"wrote {args.json}")
    return 0


MODEL_HELP = "a GGUF file, a Hugging Face snapshot directory (llama, qwen3, gemma3, qwen3moe), or a reference model name: gemma-3-270m, qwen2.5-coder-0.5b"


def _add_numerics(p, rounding_alias: bool = False) -> None:
    """--numerics (alchemist.runtime.numerics); rounding_alias: also the older --llamacpp-rounding."""
    p.add_argument(
        "--numerics",
        choices=["ggml", "exact"],
        default=None,
        help="ggml (default): compute as llama.cpp's CPU backend does (activations rounded to each weight's "
        "vec_dot_type, GELU from ggml's fp16 table); exact: multiply exact activations (the differentiable reference)",
    )
    if rounding_alias:
        p.add_argument("--llamacpp-rounding", action="store_true", help="the older spelling of --numerics ggml")


def _numerics(args) -> str:
    from alchemist.runtime.numerics import resolve_numerics

    return resolve_numerics(args.numerics, getattr(args, "llamacpp_rounding", False))


def _numerics_suffix(numerics: str) -> str:
    """Report file stems: the default numerics' reports keep their names, the others' are told apart."""
    from alchemist.runtime.numerics import DEFAULT

    return "" if numerics == DEFAULT else f"_{numerics}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alchemist", description="GGUF language models as PyTensor code")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarize a GGUF file or snapshot (or print its IR as JSON)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--ir", action="store_true", help="print the ModelIR as JSON")
    p.set_defaults(fn=_cmd_inspect)

    p = sub.add_parser("gen", help="generate the PyTensor module for a GGUF file or snapshot")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("-o", "--output", default="generated", help="output directory (default: generated/)")
    p.add_argument("--audit-dir", default="audits", help="where audit reports go (default: audits/)")
    p.add_argument("--no-audit", action="store_true", help="skip the static audit")
    p.set_defaults(fn=_cmd_gen)

    p = sub.add_parser("run", help="generate text with the PyTensor model")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", default="What's causal inference?")
    p.add_argument("--tokens", help="comma-separated prompt token ids instead of --prompt")
    p.add_argument("--backend", default="c", choices=["c", "numba", "jax", "mlx"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=1024, help="KV cache capacity in tokens")
    p.add_argument("--chat", action="store_true", default=None, help="wrap the prompt in the chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--report", help="write the JSON report here")
    _add_numerics(p)
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="split the model over N JAX devices (tensor parallel; --backend jax; on CPU set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    p.add_argument(
        "--split",
        choices=["rows", "megatron"],
        help="with --devices: the output and down projections by output rows (default with ggml numerics: the "
        "logits stay one device's bit for bit) or by input columns, one all-reduce each (default with exact)",
    )
    p.add_argument("--coordinator", help="HOST:PORT of process 0, to run as one of several jax.distributed processes")
    p.add_argument("--num-processes", type=int, default=1, help="with --coordinator: how many processes")
    p.add_argument("--process-id", type=int, default=0, help="with --coordinator: this process's index")
    p.set_defaults(fn=_cmd_run)

    p = sub.add_parser("fixture", help="write a tiny random-weight GGUF for tests")
    p.add_argument("--arch", required=True, help="a family (llama, gemma2, phi3, ...) or <family>:<variant>")
    p.add_argument("--quant", default="F32", help="F32, F16, or a llama.cpp type such as Q8_0, Q4_K")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(fn=_cmd_fixture)

    p = sub.add_parser("families", help="list the supported families; --validate runs every fixture against llama.cpp")
    p.add_argument("--validate", action="store_true", help="validate each family's fixture (minutes per family)")
    p.add_argument(
        "--cases",
        help="comma-separated fixtures (default: all; see `alchemist families`); "
        "with an existing -o file, only their rows are replaced",
    )
    p.add_argument("--backend", default="all", help="all, or a comma-separated list of c,numba,jax,mlx")
    p.add_argument("--types", default="F32,Q8_0,Q4_K", help="weight types (default F32,Q8_0,Q4_K)")
    p.add_argument("--generate", type=int, default=32, help="greedy tokens checked per run")
    p.add_argument("--workdir", default="validation/families", help="where the fixture files go")
    p.add_argument("-o", "--output", default="docs/architectures.json", help="the results (JSON)")
    p.add_argument(
        "--table",
        default=None,
        metavar="PATH",
        help="also rewrite the architecture table (between its marker comments) in this markdown file, "
        "e.g. docs/architectures.md",
    )
    p.add_argument("--readme", dest="table", metavar="PATH", help="deprecated: the older spelling of --table")
    p.set_defaults(fn=_cmd_families)

    p = sub.add_parser(
        "validate", help="check the generated model against llama.cpp or mlx-lm (JSON + markdown + PNG report)"
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--oracle", default="llama.cpp", choices=("llama.cpp", "mlx-lm"),
                   help="llama.cpp (a GGUF file) or mlx-lm (a snapshot directory; exact numerics)")  # fmt: skip
    p.add_argument("--gguf", default=None, help="with --oracle mlx-lm: the snapshot's GGUF conversion; the prompt's "
                   "logits of alchemist, mlx-lm and llama.cpp compared side by side")  # fmt: skip
    p.add_argument("--backend", default="all", help="all, or a comma-separated list of c,numba,jax,mlx")
    p.add_argument("--prompt", default=None, help="prompt text (default: a fixed sentence)")
    p.add_argument("--tokens", help="comma-separated prompt token ids instead of --prompt")
    p.add_argument("--generate", type=int, default=32, help="greedy tokens to check (fresh-prefix decisions)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("-o", "--output", default="validation", help="report directory (default: validation/)")
    _add_numerics(p, rounding_alias=True)
    p.add_argument("--devices", type=int, default=1, help="the jax backend's model split over N devices (on CPU "
                   "set XLA_FLAGS=--xla_force_host_platform_device_count=N)")  # fmt: skip
    p.set_defaults(fn=_cmd_validate)

    p = sub.add_parser(
        "diff", help="layer-by-layer comparison with llama.cpp; names the first divergent op (JSON + markdown + PNG)"
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--backend", default="c", choices=["c", "numba", "jax", "mlx"])
    p.add_argument("--prompt", default=None)
    p.add_argument("--tokens", help="comma-separated prompt token ids instead of --prompt")
    p.add_argument(
        "--tol", type=float, default=None, help="NMSE tolerance (default 1e-6 exact weights, 1e-2 quantized)"
    )
    p.add_argument(
        "--fed",
        action="store_true",
        help="also run every layer on llama.cpp's own input to it: each layer's own error (one more compile)",
    )
    p.add_argument(
        "--fed-ops",
        action="store_true",
        help="--fed, and every tap also computed from llama.cpp's taps before it: which op is not bit-exact",
    )
    p.add_argument("--fed-tol", type=float, default=None, help="the fed NMSE tolerance per tap (default 1e-10)")
    p.add_argument("-o", "--output", default="validation", help="report directory (default: validation/)")
    _add_numerics(p, rounding_alias=True)
    p.set_defaults(fn=_cmd_diff)

    p = sub.add_parser("explain", help="per-token saliency (gradient x input) of log p(target | prompt)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", help="the conditioning text (tokenized with BOS as the model adds it)")
    p.add_argument("--target", help="the continuation whose log-probability is explained")
    p.add_argument("--prompt-tokens", help="comma-separated token ids instead of --prompt")
    p.add_argument("--target-tokens", help="comma-separated token ids instead of --target")
    p.add_argument("--backend", default="c", choices=["c", "numba", "jax", "mlx"])
    p.add_argument("--context", type=int, default=512, help="longest prompt + target (tokens)")
    p.add_argument("-o", "--output", help="also draw the attributions (.png or .svg)")
    p.add_argument("--json", help="also write the attributions as JSON")
    p.set_defaults(fn=_cmd_explain)

    p = sub.add_parser("tokenize", help="print token ids and pieces for a text")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("text")
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.set_defaults(fn=_cmd_tokenize)

    p = sub.add_parser("chat", help="chat in the terminal (streamed; earlier turns' KV is reused)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--backend", default="c", choices=["c", "numba", "jax", "mlx"])
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="longest answer in tokens")
    p.add_argument("--context", type=int, default=4096, help="KV cache capacity in tokens (the whole conversation)")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk in tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    _add_numerics(p)
    p.set_defaults(fn=_cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("model", help=MODEL_HELP)
    from alchemist.serve.cli import add_arguments as add_serve_arguments

    add_serve_arguments(p)
    _add_numerics(p)
    p.set_defaults(fn=_cmd_serve)

    p = sub.add_parser("graph", help="one layer's PyTensor graph, before or after a backend's rewrites")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--layer", type=int, default=0, help="layer index (default 0)")
    p.add_argument("--rewrites", action="store_true", help="the graph after the backend's rewrites, with a summary")
    p.add_argument("--backend", default="c", help="c, numba, jax or mlx (default c)")
    p.add_argument("--format", default=None, help="text, dot, png or svg (default: from -o's extension, else text)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per step (default 1: decode)")
    p.add_argument("--capacity", type=int, default=16, help="KV cache rows (default 16)")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(fn=_cmd_graph)

    p = sub.add_parser("card", help="the architecture's block diagram; two models: what differs")
    p.add_argument("models", nargs="+", metavar="MODEL", help=MODEL_HELP + " (one, or two to compare)")
    p.add_argument("-o", "--output", help="draw the card(s) into this .png or .svg")
    p.set_defaults(fn=_cmd_card)

    p = sub.add_parser("perplexity", help="perplexity of a text file, windowed, beside llama.cpp's on the same windows")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("--context", type=int, default=512, help="tokens per window, BOS included (default 512)")
    p.add_argument("--stride", type=int, default=None, help="window advance in tokens (default: no overlap)")
    p.add_argument("--backend", default="c", choices=["c", "numba", "jax", "mlx"])
    p.add_argument(
        "--oracle", action=argparse.BooleanOptionalAction, default=True, help="also score with llama.cpp (default)"
    )
    p.add_argument("--json", help="write per-token log-probabilities and the summary here")
    _add_numerics(p, rounding_alias=True)
    p.set_defaults(fn=_cmd_perplexity)

    try:
        from alchemist.audit.cli import register as register_audit
    except ImportError:
        pass
    else:
        register_audit(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "model", None) is not None:
            from alchemist.models import resolve_model

            args.model = resolve_model(args.model)
        return args.fn(args)
    except AlchemistError as e:
        print(f"alchemist: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `alchemist inspect ... | head`
        return 0
    except KeyboardInterrupt:
        print("alchemist: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
