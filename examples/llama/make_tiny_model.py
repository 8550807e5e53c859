#!/usr/bin/env python3
"""Makes a seeded random model (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3
text) with transformers (no download), saves it as save_pretrained does, and
writes requests and transformers' own greedy outputs for them.

    make_tiny_model.py OUT_DIR [--preset NAME] [--seed N] [--no-reference]

OUT_DIR receives:
  config.json, model.safetensors (or shards + model.safetensors.index.json)
  requests.jsonl    the requests, for `llama --requests`
  reference.jsonl   per request: transformers' generate (greedy): "tokens" and,
                    per generated token, the raw "logits" it was chosen from
  reference.json    how it was made (versions, preset) and the smallest gap
                    between the top two logits of any step

Presets (tiny unless named bench):
  gqa       8 query heads on 2 kv heads, llama3 RoPE scaling, rope_theta 500000,
            tied embeddings, float32 weights, eos_token_id a list of two ids
  mha       4 heads, 4 kv heads, default RoPE, untied lm_head, bfloat16 weights,
            eos_token_id an int
  head-dim  an explicit head_dim (32, with hidden 96 and 4 heads), 1 kv head (MQA),
            float16 weights in shards
  bench     the ~100M shape of the benchmark (hidden 1024, 8 layers, 16 heads,
            4 kv heads): weights only, no requests
  gemma3-bench  a ~90M Gemma-3 shape for bench/llama_windows.py (gemma3_text,
            hidden 1024, 6 layers: 5 sliding (window 512) : 1 full, 8 heads
            on 4 kv heads of 128): weights only, no requests
One preset per other family, each with a window far shorter than the longer
prompts (1 to 100 tokens), so that sliding layers drop pages as they go:
  mistral   sliding window 14 (two pages of 7) on both layers, GQA 4:2
  qwen2     q/k/v biases, use_sliding_window with max_window_layers 2 of 4
            (layers 2 and 3 slide, window 12), tied embeddings
  qwen3     q/k RMSNorm, head_dim 32 beside hidden 64, attention_bias, no window
  gemma2    4 layers alternating sliding (window 8) and full, attention and
            final logit soft-caps low enough to bend these logits (8, 15),
            query_pre_attn_scalar 24, GELU-tanh, Gemma's norms and embedding scale
  gemma3    gemma3_text: 6 layers, 5 sliding (window 10) : 1 full, q/k norm,
            local RoPE base 10000 and a global one of 1e6 with linear scaling 4,
            MQA

Weights are random but not transformers' tiny default init: the norms' weights
vary around 1 and the projections have a larger spread, so that the logits
spread over several units and greedy choices are not near-ties. The
reference's smallest top-1 / top-2 gap is reported; a gap under GAP_FLOOR
(2 x the tests' logit tolerance) fails the script, since there two
implementations within tolerance of each other may pick different tokens.

Run with transformers and torch importable, e.g.
  PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2 python3 make_tiny_model.py /tmp/tiny
"""
import argparse
import json
import os
import shutil
import sys

LOGIT_TOLERANCE = 1e-4
GAP_FLOOR = 2 * LOGIT_TOLERANCE
DEFAULT_MAX_NEW_TOKENS = 12  # what requests without "max_new_tokens" get; the tests pass it as --max-new-tokens

PRESETS = {
    "gqa": dict(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=True, weights_dtype="float32",
                rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=32),
                eos="list", rms_norm_eps=1e-5),
    "mha": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False, weights_dtype="bfloat16",
                eos="int", rms_norm_eps=1e-6),
    "head-dim": dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=32, rope_theta=20000.0, tie_word_embeddings=False,
                     weights_dtype="float16", shard="40KB", eos="int", rms_norm_eps=1e-6),
    "mistral": dict(family="mistral", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
                    weights_dtype="float32", eos="int", rms_norm_eps=1e-5, extra=dict(sliding_window=14)),
    "qwen2": dict(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True,
                  weights_dtype="float32", eos="list", rms_norm_eps=1e-6,
                  extra=dict(use_sliding_window=True, sliding_window=12, max_window_layers=2)),
    "qwen3": dict(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
                  tie_word_embeddings=False, weights_dtype="float32", eos="int", rms_norm_eps=1e-6,
                  extra=dict(attention_bias=True)),
    "gemma2": dict(family="gemma2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                   tie_word_embeddings=True, weights_dtype="float32", eos="int", rms_norm_eps=1e-6,
                   extra=dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=8.0,
                              final_logit_softcapping=15.0)),
    "gemma3": dict(family="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                   weights_dtype="float32", eos="int", rms_norm_eps=1e-6,
                   rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
                                        sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
                   extra=dict(sliding_window=10, query_pre_attn_scalar=16)),
    "bench": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=True,
                  weights_dtype="float32", eos=None, rms_norm_eps=1e-5, max_position_embeddings=4096, bench=True),
    "gemma3-bench": dict(family="gemma3_text", vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                         num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                         tie_word_embeddings=True, weights_dtype="float32", eos=None, rms_norm_eps=1e-6,
                         max_position_embeddings=8192, bench=True,
                         rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1000000.0),
                                              sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
                         extra=dict(sliding_window=512, query_pre_attn_scalar=128)),
}


def family(preset):
    return PRESETS[preset].get("family", "llama")


def model_class(preset):
    """transformers' causal LM class of the preset's family."""
    import transformers

    return {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
            "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
            "gemma2": transformers.Gemma2ForCausalLM, "gemma3_text": transformers.Gemma3ForCausalLM}[family(preset)]


def build_model(preset, seed):
    """A random causal LM of the preset's family and shape, in float32."""
    import torch
    from transformers import AutoConfig

    p = PRESETS[preset]
    kwargs = dict(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
                  num_hidden_layers=p["num_hidden_layers"], num_attention_heads=p["num_attention_heads"],
                  num_key_value_heads=p["num_key_value_heads"], rms_norm_eps=p["rms_norm_eps"],
                  tie_word_embeddings=p["tie_word_embeddings"],
                  max_position_embeddings=p.get("max_position_embeddings", 512), bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if "head_dim" in p:
        kwargs["head_dim"] = p["head_dim"]
    if "rope_parameters" in p:
        kwargs["rope_parameters"] = p["rope_parameters"]
    else:
        rope = dict(rope_type="default", rope_theta=p["rope_theta"])
        if "rope_scaling" in p:
            rope.update(p["rope_scaling"])
        kwargs["rope_parameters"] = rope
    kwargs.update(p.get("extra", {}))
    config = AutoConfig.for_model(family(preset), **kwargs)
    torch.manual_seed(seed)
    model = model_class(preset)(config).eval()
    gemma = family(preset).startswith("gemma")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name == "model.norm.weight":  # the logits' scale: a few units apart at the top
                w.copy_(4 * (1 + 0.25 * torch.randn(w.shape, generator=g)) - (1 if gemma else 0))
            elif name.endswith("norm.weight"):  # Gemma's norms multiply by 1 + weight
                w.copy_((0 if gemma else 1) + 0.25 * torch.randn(w.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                w.copy_(0.1 * torch.randn(w.shape, generator=g))  # small beside the layers: outputs vary
            elif name.endswith(".bias"):
                w.copy_(0.5 * torch.randn(w.shape, generator=g))
            else:  # a linear [out, in]: unit-variance outputs for unit-variance inputs, a bit more
                w.copy_(torch.randn(w.shape, generator=g) * (1.5 / w.shape[1] ** 0.5))
    return model


def save(model, preset, out_dir):
    import torch

    p = PRESETS[preset]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[p["weights_dtype"]]
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # a previous model's shards must not linger
        if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".json")):
            os.remove(os.path.join(out_dir, name))
    kwargs = {"max_shard_size": p["shard"]} if "shard" in p else {}
    model.to(dtype).save_pretrained(out_dir, **kwargs)  # converts in place: the caller reloads


def make_requests(preset, seed):
    """Prompts of many lengths (1 token, one page, several pages), four sharing
    a 64-token prefix, one without max_new_tokens."""
    import random

    rng = random.Random(seed)
    vocab = PRESETS[preset]["vocab_size"]

    def tokens(n):
        return [rng.randrange(vocab) for _ in range(n)]

    shared = tokens(64)
    prompts = [tokens(1), tokens(5), tokens(16), tokens(37), tokens(100), shared + tokens(3), shared + tokens(10),
               shared + [rng.randrange(vocab)], shared + tokens(25), tokens(47)]
    new_tokens = [10, 24, 8, 16, 20, 12, 16, 8, 20, None]
    requests = []
    for i, (prompt, m) in enumerate(zip(prompts, new_tokens)):
        r = {"id": f"{preset}-{i}", "prompt": prompt}
        if m is not None:
            r["max_new_tokens"] = m
        requests.append(r)
    return requests


def generate(model, requests, eos):
    """transformers' greedy generate, one request at a time (no padding)."""
    import torch

    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    out = []
    with torch.no_grad():
        for r in requests:
            ids = torch.tensor([r["prompt"]])
            g = model.generate(ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=r.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), do_sample=False,
                               output_logits=True, return_dict_in_generate=True, eos_token_id=eos,
                               pad_token_id=model.generation_config.pad_token_id)
            tokens = g.sequences[0, ids.shape[1]:].tolist()
            logits = [step[0].float() for step in g.logits]
            assert len(logits) == len(tokens)
            out.append({"id": r["id"], "tokens": tokens, "logits": logits})
    return out


# What transformers' run of a saved model computes in: its dtype, or float32
# with K and V rounded as pagedkv's quantized pages store them.
VARIANTS = ("float32", "bfloat16", "float16", "fp8", "int8")


def fake_quantize(x, fmt):
    """K or V [.., head_dim] rounded per head vector as pagedkv stores it:
    scale = amax / 448 (fp8 e4m3, round to nearest even) or amax / 127 (int8,
    round half to even, codes in [-127, 127]), then code x scale."""
    import torch

    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / (448 if fmt == "fp8" else 127)
    scaled = torch.where(scale > 0, x / scale, torch.zeros_like(x))
    code = scaled.to(torch.float8_e4m3fn).float() if fmt == "fp8" else torch.round(scaled).clamp(-127, 127)
    return code * scale


def load_variant(out_dir, variant):
    """transformers' model of out_dir computing as `variant` says (VARIANTS)."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if variant in ("fp8", "int8"):
        def attention(module, query, key, value, attention_mask, **kwargs):
            return sdpa_attention_forward(module, query, fake_quantize(key, variant), fake_quantize(value, variant),
                                          attention_mask, **kwargs)

        AttentionInterface.register("pagedkv_" + variant, attention)
        return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                    attn_implementation="pagedkv_" + variant).eval()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[variant]
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype).eval()


def reference_variant(out_dir, variant):
    """transformers' greedy outputs for out_dir's requests, computed as
    `variant` says: {id: {"tokens", "logits"}} (logits as float32 tensors)."""
    with open(os.path.join(out_dir, "requests.jsonl")) as f:
        requests = [json.loads(line) for line in f]
    with open(os.path.join(out_dir, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return {r["id"]: r for r in generate(load_variant(out_dir, variant), requests, eos)}


def min_gap(reference):
    """The smallest top-1 minus top-2 logit over every step, and where."""
    best = (float("inf"), None, None)
    for r in reference:
        for step, logits in enumerate(r["logits"]):
            top = logits.topk(2).values
            gap = float(top[0] - top[1])
            if gap < best[0]:
                best = (gap, r["id"], step)
    return best


def pick_eos(preset, reference):
    """EOS ids the model actually produces, so that some requests stop early:
    the 4th token of the 5th request (and, for "list", the 6th of the 4th)."""
    kind = PRESETS[preset]["eos"]
    first = reference[4]["tokens"][3]
    if kind == "list":
        second = reference[3]["tokens"][5]
        return [first, second] if second != first else [first]
    return first


def stop_at_eos(r, eos):
    """A generate output cut after its first EOS token, which it keeps."""
    ids = set(eos if isinstance(eos, list) else [eos])
    n = next((i + 1 for i, t in enumerate(r["tokens"]) if t in ids), len(r["tokens"]))
    return {"id": r["id"], "tokens": r["tokens"][:n], "logits": r["logits"][:n]}


def make(out_dir, preset="gqa", seed=0, reference=True):
    """Builds, saves and (unless reference=False) runs the reference; returns reference.json's content."""
    import torch
    import transformers

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = build_model(preset, seed)
    info = {"preset": preset, "family": family(preset), "seed": seed, "torch": torch.__version__, "transformers": transformers.__version__,
            "default_max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "logit_tolerance": LOGIT_TOLERANCE}
    if not reference:
        save(model, preset, out_dir)
        return info
    requests = make_requests(preset, seed)
    # The reference runs the saved weights (bf16 / fp16 ones upcast to
    # float32), as the engine will. First without EOS, to choose EOS ids the
    # model emits; then with them.
    cls = model_class(preset)
    save(model, preset, out_dir)
    model = cls.from_pretrained(out_dir, dtype=torch.float32).eval()
    free = generate(model, requests, eos=None)
    eos = pick_eos(preset, free)
    model.config.eos_token_id = eos
    save(model, preset, out_dir)  # the same values: float32 upcasts round-trip to the stored dtype
    # Greedy generate of one request at a time computes the same steps with
    # EOS as without up to its first EOS, where it stops: the run without,
    # cut there, is the reference (a second generate would cost as much again).
    ref = [stop_at_eos(r, eos) for r in free]
    gap, gap_id, gap_step = min_gap(ref)
    stopped = [r["id"] for r, q in zip(ref, requests)
               if len(r["tokens"]) < q.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)]
    info.update(eos_token_id=eos, min_gap=gap, min_gap_at={"id": gap_id, "step": gap_step}, stopped_by_eos=stopped,
                steps=sum(len(r["tokens"]) for r in ref))
    with open(os.path.join(out_dir, "requests.jsonl"), "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(out_dir, "reference.jsonl"), "w") as f:
        for r in ref:
            f.write(json.dumps({"id": r["id"], "tokens": r["tokens"],
                                "logits": [step.tolist() for step in r["logits"]]}) + "\n")
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(info, f, indent=1)
    if gap < GAP_FLOOR:
        raise SystemExit(f"make_tiny_model: near-tie in transformers' reference: request {gap_id} step {gap_step} "
                         f"has its top two logits {gap:.3g} apart (< {GAP_FLOOR:g}); an implementation within "
                         f"{LOGIT_TOLERANCE:g} of it may pick either token. Use another --seed.")
    if not stopped:
        raise SystemExit("make_tiny_model: no request stopped at an EOS token; the EOS path would go untested")
    return info


def write_v4_config(src_dir, dst_dir):
    """A copy of src_dir whose config.json is spelled as transformers 4 wrote
    it: RoPE as top-level rope_theta and optional rope_scaling instead of 5's
    rope_parameters (gemma3_text: rope_theta and rope_scaling for the full
    layers, rope_local_base_freq for the sliding ones), and no layer_types
    (the family's rule: max_window_layers, alternation, sliding_window_pattern);
    the weights are linked, not copied."""
    os.makedirs(dst_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        if name != "config.json" and (name.endswith(".safetensors") or name.endswith(".index.json")):
            target = os.path.join(dst_dir, name)
            if os.path.lexists(target):
                os.remove(target)
            os.symlink(os.path.abspath(os.path.join(src_dir, name)), target)
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    if config["model_type"] == "gemma3_text":
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        config["sliding_window_pattern"] = 6
        rope = dict(rope["full_attention"])
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config.pop("layer_types", None)
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="gqa", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-reference", action="store_true", help="save the model only")
    a = ap.parse_args()
    info = make(a.out_dir, a.preset, a.seed, reference=not a.no_reference and not PRESETS[a.preset].get("bench"))
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    sys.exit(main())
