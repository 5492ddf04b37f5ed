"""The plugin's report, as written to `<output_dir>/fastqwen_report.json` and printed.

Kept free of torch, transformers and Axolotl imports so that `python -m axolotl_fastqwen report`
answers in a fraction of a second.
"""

from __future__ import annotations

REPORT_FILE = "fastqwen_report.json"


def format_report(d: dict, checkpointing: dict | None = None) -> str:
    """The load-time table, from `PatchReport.to_dict()` (also as read back from the JSON file);
    `checkpointing` (the report's entry, once training ran) says why no layer kept activations."""
    lines = [
        f"axolotl_fastqwen: {d['family']} ({d['model_class']}) on {d['device']}, kernels={d['mode']}: "
        f"{d['layers_patched']['gated_deltanet']} Gated DeltaNet + {d['layers_patched']['attention']} attention "
        f"layers patched" + (f", {d['rms_norms_patched']} RMSNorms" if d.get("rms_norms_patched") else "")
        + (f", {d['mlps_patched']} SwiGLU MLPs" if d.get("mlps_patched") else ""),
        f"  {'op':<22} {'backend':<16} {'self-check / why others were not used'}",
    ]
    for op, info in d["ops"].items():
        detail = info["selfcheck"] or ("not self-checked (CPU)" if d["device"] == "cpu" else "")
        if info["rejected"]:
            detail = (detail + "; " if detail else "") + "not: " + "; ".join(info["rejected"])
        lines.append(f"  {op:<22} {info['backend']:<16} {detail}")
    experts = d.get("experts")
    if experts:
        lines.append(f"  {'routed experts':<22} {str(experts['implementation']):<16} {experts['modules']} x "
                     f"{experts['class']}, run by {experts['runner']}")
        if experts.get("selfcheck"):
            rejected = experts.get("rejected") or []
            lines.append(f"  {'':<22} {'':<16} self-check: {experts['selfcheck']}"
                         + ("; not: " + "; ".join(rejected) if rejected else ""))
        if experts.get("stacks"):
            lines.append(f"  {'':<22} {'':<16} stacks: {experts['stacks']}")
        if experts.get("not_grouped"):
            lines.append(f"  {'':<22} {'':<16} {experts['not_grouped']}")
        if experts.get("routed_rows"):
            lines.append(f"  {'':<22} {'':<16} routed rows: {experts['routed_rows']}")
        if experts.get("shared_expert"):
            lines.append(f"  {'':<22} {'':<16} shared expert: {experts['shared_expert']}")
        for kind in experts.get("by_module_kind", [])[1:]:
            lines.append(f"  {'':<22} {str(kind['implementation']):<16} {kind['modules']} x {kind['class']}, run by "
                         f"{kind['runner']}")
    lines += _fp8_lines(d.get("fp8"))
    fused = d.get("fused_lora")
    if fused and fused["layers"]:
        others = "; ".join(f"{why}: {n} calls" for why, n in fused["peft_calls"].items())
        lines.append(f"  fused LoRA: {fused['layers']} peft LoRA linear layers, {fused['fused_calls']} calls with the "
                     "adapter added by the GEMM (no full-size scale or add)"
                     + (f"; peft's own forward where {others}" if others else ""))
        copies = fused.get("weight_copies")
        if copies and copies["state"] == "on":
            lines.append(f"  {'':<12}adapters of {copies['layers']} decoder layers cast to the compute dtype once a "
                         f"forward, s·B folded ({copies['bytes'] / 2**20:.1f} MiB; multi-tensor kernels, "
                         "lora_weight_copies.py)")
        elif copies and copies["state"].startswith("off: "):
            lines.append(f"  {'':<12}adapter casts per layer: {copies['state'].removeprefix('off: ')}")
    chunks = d.get("mlp_chunks")
    if chunks is not None:
        lines.append(f"  mlp chunks: {chunks['mlps']} dense MLPs run rows of more than {chunks['chunk_tokens']} tokens "
                     f"in chunks of that many, each recomputed in backward ({chunks['chunked_forwards']} chunked "
                     "forwards so far)")
    graphs = d.get("moe_cuda_graphs")
    if graphs is not None:
        lines.append(f"  moe cuda graphs: {graphs['summary']}")
    offload = d.get("checkpoint_offload")
    if offload is not None and offload.get("mode") == "auto" and not offload["active"]:
        lines.append(f"  checkpoint offload: auto, {offload['why'] or 'off until a training forward decides'}")
    elif offload is not None and not offload["offloaded_inputs"]:
        lines.append("  checkpoint offload: on (recomputed layers' inputs to pinned host memory, prefetched one layer "
                     "ahead in backward; nothing moved yet)")
    elif offload is not None:
        if offload.get("mode") == "auto":
            lines.append(f"  checkpoint offload: auto, {offload['why']}")
        lines.append(f"  checkpoint offload: {offload['last_forward_inputs']} recomputed layers' inputs in pinned host "
                     f"memory at the last training forward ({offload['last_forward_gib']} GiB; "
                     f"{offload['prefetched']} of {offload['restored']} restores prefetched one layer ahead; "
                     f"{offload['kept_on_device']} kept on the device at the host limit of "
                     f"{offload['host_limit_gib']} GiB)")
    for note in d["notes"]:
        lines.append(f"  note: {note}")
    if d["boundary_sources"]:
        lines.append(f"  boundaries from: {', '.join(d['boundary_sources'])}")
    if d.get("forwards_without_trainable_tokens"):
        lines.append(f"  training forwards without a trainable token (loss 0, no update): "
                     f"{d['forwards_without_trainable_tokens']}")
    lean = d.get("lean_activations")
    if lean is not None and not lean["lean_layers_last_forward"]:
        lines.append(f"  lean activations: on; {_why_nothing_lean(checkpointing)}")
    elif lean is not None:
        kept = "; kept: " + ", ".join(f"{n} save{'s' if n != 1 else ''} ({why})"
                                      for why, n in lean["saves_kept"].items()) if lean["saves_kept"] else ""
        n = lean["outputs_dropped_per_forward"]
        lines.append(f"  lean activations: {n} output{'s' if n != 1 else ''} dropped in "
                     f"{lean['lean_layers_last_forward']} of {lean['layers_hooked']} layers at the last training "
                     f"forward ({lean['mib_dropped_per_forward']} MiB), recomputed in backward{kept}")
    versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items() if v)
    lines.append(f"  versions: {versions}")
    return "\n".join(lines)


# how the report names each `fp8_input_gradient` (ops/fp8_linear.INPUT_GRADIENTS)
INPUT_GRADIENT_TEXT = {"fp8": "output gradients per token", "fp8-1x128": "output gradients per 1x128 block",
                       "bf16": "input gradients in bf16 on the dequantized weights"}


def _fp8_lines(fp8: dict | None) -> list[str]:
    """fastqwen_fp8: each frozen projection's decision, and the memory it moved."""
    if not fp8:
        return []
    gib = 1024 ** 3
    dy = INPUT_GRADIENT_TEXT.get(fp8.get("input_gradient"), fp8.get("input_gradient"))
    stacks = fp8.get("expert_stacks_fp8") or 0
    experts = (f" and {stacks} routed-expert stacks (grouped GEMMs, "
               f"{INPUT_GRADIENT_TEXT.get(fp8.get('experts_input_gradient'), fp8.get('experts_input_gradient'))})"
               if stacks else "")
    lines = [f"  fp8 frozen GEMMs: {fp8['modules_fp8']} projections{experts} in FP8 (e4m3; weights per output channel, "
             f"inputs per token, {dy}); GPU weights {fp8['bf16_bytes_freed'] / gib:.2f} GiB bf16 -> "
             f"{fp8['fp8_bytes'] / gib:.2f} GiB FP8, bf16 copy on host ({fp8['host_bytes'] / gib:.2f} GiB) for "
             "unpatch_model"]
    for role, row in fp8["projections"].items():
        shape = "x".join(map(str, row["shape"])) if row["shape"] else "-"
        lines.append(f"    {role:<24} {shape:<12} {'fp8' if row['fp8'] else 'bf16':<5} {row['why']}")
    return lines


def _why_nothing_lean(checkpointing: dict | None) -> str:
    """Why lean activations dropped nothing: every layer was recomputed (and why), or no training
    forward has run yet."""
    if checkpointing is None:
        return "no layer that keeps its activations has run a training forward yet"
    if checkpointing.get("mode") == "auto" and checkpointing.get("phase") == "off":
        return f"dropped nothing: every layer was recomputed ({checkpointing.get('summary')})"
    if checkpointing.get("mode") == "auto" and not checkpointing.get("kept_layers"):
        return "dropped nothing so far: fastqwen_checkpointing: auto had kept no layer yet"
    if checkpointing.get("mode") == "full":
        return "dropped nothing: gradient_checkpointing recomputed every layer"
    return "no training forward of a layer that keeps its activations ran"


ROWS = {"multipack": "Axolotl's multipack rows", "flattening": "HF's flattened rows", "padded": "padded batches",
        "fastqwen": "the plugin's packed rows"}


def format_settings(settings: dict) -> list[str]:
    """What the plugin decided at config load, one line each."""
    return [f"decided: {line}" for line in settings.get("decisions") or []]


def format_packing(packing: dict) -> list[str]:
    """The packing lines of a report: what was replaced, overlong handling, then one line per
    planned epoch, against padded batches and against the rows the YAML asked for."""
    if not packing.get("active"):
        return [f"packing: the plugin's packer is off; the training rows are "
                f"{ROWS.get(packing.get('rows'), 'as Axolotl builds them')}"]
    lines = []
    if packing.get("replaced") in ("multipack", "flattening"):
        lines.append(f"packing: the plugin's packer runs in place of {ROWS[packing['replaced']]}: same tokens per "
                     "step, a different step composition (steps per epoch, warm-up and eval/save cadence in steps); "
                     "per-step loss equal to Axolotl's needs fastqwen_packing: false and a fixed seed")
    for name in ("train", "eval"):
        cut = packing.get(f"overlong_{name}")
        if cut and cut.get("overlong_samples"):
            n = cut["overlong_samples"]
            what = (f"truncated, {cut['tokens_dropped']:,} tokens dropped" if cut["mode"] == "truncate"
                    else f"split into {cut['pieces']} pieces")
            lines.append(f"overlong ({name}): {n} sample{'s' if n != 1 else ''} ({cut['tokens_in_overlong']:,} "
                         f"tokens) {what}")
    for i, e in enumerate(packing["epochs"]):
        lines.append(
            f"packing, epoch {i}: {e['samples']:,} samples, {e['real_tokens']:,} tokens -> {e['bins']:,} rows of "
            f"{packing['token_budget']} (lower bound {e['lower_bound']:,}), padding "
            f"{100 * e['padding_fraction']:.1f}%, {e['reduction_vs_padded_pct']:.1f}% fewer steps than "
            f"{e['padded_batches']:,} padded batches of {e['micro_batch_size']}"
        )
    vision = packing.get("multimodal")
    if vision:
        lines.append(f"image+text: {vision['images']:,} images, {vision['vision_tokens']:,} vision tokens "
                     f"({vision['images_per_row']} images, {vision['vision_tokens_per_row']} vision tokens a row); "
                     f"lengths: {vision['lengths_from']}")
    multipack = packing.get("multipack")
    if multipack and packing.get("epochs"):
        bins = packing["epochs"][0]["bins"]
        lines.append(f"packing vs multipack, epoch 0: {bins:,} rows of {packing['token_budget']} where Axolotl's "
                     f"multipack would run {multipack['micro_batches']:,} micro-batches of {multipack['micro_batch_size']}"
                     f" x {multipack['sequence_len']} ({100 * (1 - bins / multipack['micro_batches']):.1f}% fewer)")
    return lines
