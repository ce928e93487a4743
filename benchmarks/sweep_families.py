"""Never silently wrong, checked on families nopad was not written for: every
model_type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` the installed release ships.

    python benchmarks/sweep_families.py                 # every family, each in its own subprocess
    python benchmarks/sweep_families.py llama gemma3    # only these
    python benchmarks/sweep_families.py --one llama     # one family in-process (what the driver runs)

The whole sweep takes about 30 minutes on one CPU thread (196 families in transformers 5.24).
Per family: build a tiny random fp32 model (benchmarks/_tiny_configs.py), then
  verify_flat  nopad.packing.verify(model, lengths (1, 37, 5, 20))
  verify_tree  nopad.packing.verify(model, tree_sequences(2), tree=True)
  generate     nopad.inference.Generator(...) greedy, 8 tokens, prompts of 5 and 23 tokens, against HF
               generate on each prompt alone (batch 1, no padding, no EOS stop) and a cache-free
               greedy loop (full forward per token).
Each check prints one line `family check OUTCOME detail`; outcomes:
  OK / OK-LOOSE (logits + whole gradient exact, verify's per-tensor bound not met) /
  SILENT-WRONG (no error, wrong result) / REFUSED (nopad error) / CRASH (error outside nopad or
  an unhelpful one) / HF-FAIL (the HF reference itself failed) / SKIP.
Lines are also appended as JSON to ``SWEEP_RESULTS`` (default sweep_results.jsonl, here).
A SILENT-WRONG or CRASH row is a defect of nopad's (the HF reference disagreeing is HF-FAIL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN = os.path.dirname(HERE)  # the repository root
RESULTS = os.environ.get("SWEEP_RESULTS", "sweep_results.jsonl")
TIMEOUT = int(os.environ.get("SWEEP_TIMEOUT", "120"))

SKIP = {
    "musicgen": "audio codebooks: input_ids are (batch*num_codebooks, T), not a text decoder",
    "musicgen_melody": "audio codebooks: input_ids are (batch*num_codebooks, T), not a text decoder",
    "gemma3n": "composite needs timm for its vision tower (not installed); decoder covered by gemma3n_text",
    "gemma4_assistant": "speculative-decoding drafter: needs the target model's shared_kv_states",
    "gemma4_unified_assistant": "speculative-decoding drafter: needs the target model's shared_kv_states",
    "dots3_note": "composite: adapter widths must equal the text width; decoder covered by dots3_note_text",
}
# decoder halves of encoder-decoder models (ForCausalLM classes that run standalone): run, but flagged
ENC_DEC_HALF = {
    "bart",
    "bigbird_pegasus",
    "blenderbot",
    "blenderbot-small",
    "marian",
    "mbart",
    "mvp",
    "pegasus",
    "plbart",
    "prophetnet",
    "trocr",
    "whisper",
}
# encoder families used as decoders (is_decoder=True)
ENCODER_AS_DECODER = {
    "bert",
    "bert-generation",
    "big_bird",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "megatron-bert",
    "rembert",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "roformer",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xmod",
}


# ----------------------------------------------------------------------------------------- one family
def _frames(exc):
    tb = traceback.extract_tb(exc.__traceback__)
    main = [f for f in tb if f.filename.startswith(MAIN)]
    tfm = [f for f in tb if "site-packages/transformers" in f.filename]

    def fmt(f):
        return f"{f.filename.replace(MAIN + '/', '').split('site-packages/')[-1]}:{f.lineno} {f.name}"

    return {
        "raised_at": fmt(tb[-1]) if tb else "",
        "deepest_nopad": fmt(main[-1]) if main else "",
        "deepest_transformers": fmt(tfm[-1]) if tfm else "",
    }


def _classify_error(exc) -> dict:
    from nopad.packing.mixers import UnsupportedMixerError

    info = {"exc": type(exc).__name__, "msg": str(exc)[:1500].replace("\n", " | "), **_frames(exc)}
    raised_in_nopad = info["raised_at"] and not info["raised_at"].startswith(("transformers/", "torch/"))
    raised_in_nopad = raised_in_nopad and "site-packages" not in info["raised_at"]
    # a refusal of nopad's own: its error types, or any error that sends the user to the model docs
    clear_type = isinstance(exc, (UnsupportedMixerError, ValueError, NotImplementedError))
    clear_type = clear_type or "docs/models.md" in str(exc)
    info["outcome"] = "REFUSED" if (raised_in_nopad and clear_type) else "CRASH"
    return info


def _emit(family, check, **rec):
    rec = {"family": family, "check": check, **rec}
    {k: v for k, v in rec.items() if k not in ("family", "check", "outcome")}
    print(f"RESULT {json.dumps(rec)}", flush=True)
    return rec


def _ids(n, vocab, g):
    import torch

    return torch.randint(3, min(vocab, 256), (n,), generator=g)


def random_sequences(lengths, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [_ids(n, vocab, g) for n in lengths]


def tree_sequences(depth, vocab, seed=0):
    """tests/packing/test_packing_hybrid.py::tree_sequences with ids under ``vocab``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = _ids(70 if depth >= 3 else 9, vocab, g)
    paths, stem = [], prompt
    for level in range(depth):
        branches = [torch.cat([stem, _ids(n, vocab, g)]) for n in (3 + level, 1, 5)]
        paths += branches[1:]
        stem = branches[0]
    paths.append(stem)
    paths.append(prompt[:4])
    return paths


def _verify(model, family, check, seqs, tree):
    from nopad import packing

    model.train()
    try:
        rep = packing.verify(model, seqs, tree=tree)
    except Exception as exc:  # noqa: BLE001
        return _emit(family, check, **_classify_error(exc))
    restored = model.training
    tol = 1e-5 * max(1.0, rep.logit_scale)
    logits_ok = rep.max_logit_diff <= tol
    rec = dict(
        max_logit_diff=rep.max_logit_diff,
        logit_scale=rep.logit_scale,
        grad_rel_diff=rep.grad_rel_diff,
        worst_tensor=rep.max_grad_rel_diff,
        worst_param=rep.worst_param,
        loss_diff=rep.loss_diff,
        path=rep.attention_path,
        ref=rep.reference_path,
        train_mode_restored=restored,
    )
    if rep.ok():
        outcome = "OK"
    elif logits_ok and rep.grad_rel_diff <= 1e-4:
        outcome = "OK-LOOSE"  # exact logits and whole gradient; only verify's per-tensor bound missed
    else:
        outcome = "SILENT-WRONG"
    return _emit(family, check, outcome=outcome, **rec)


def _greedy_loop(model, prompt, n):
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _hf_generate(model, prompt, n):
    import torch
    from transformers import GenerationConfig

    gc = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt) :].tolist()


def _logprobs(model, prompt, completion):
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return lp[pos, torch.tensor(completion)]


def _generate(model, family, vocab):
    import torch

    from nopad.inference import Generator, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [_ids(n, vocab, g).tolist() for n in (5, 23)]
    model.eval()
    try:
        gen = Generator(model, block_size=16, max_num_batched_tokens=256, max_num_seqs=4, num_blocks=64)
    except Exception as exc:  # noqa: BLE001
        return _emit(family, "generate", stage="construct", **_classify_error(exc))
    try:
        outs = gen.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        got_lp = [o.outputs[0].logprobs for o in outs]
    except Exception as exc:  # noqa: BLE001
        return _emit(family, "generate", stage="generate", **_classify_error(exc))
    loop = [_greedy_loop(model, p, 8) for p in prompts]
    try:
        hf = [_hf_generate(model, p, 8) for p in prompts]
        hf_err = None
    except Exception as exc:  # noqa: BLE001
        hf, hf_err = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    ref = hf if hf is not None else loop
    # how far the generator's log-probs are from a full forward of its own completion
    lp_diff = 0.0
    for p, c, lp in zip(prompts, got, got_lp):
        if lp:
            lp_diff = max(lp_diff, float((torch.tensor(lp) - _logprobs(model, p, c)).abs().max()))
    rec = dict(
        got=got,
        hf=hf,
        loop=loop,
        hf_error=hf_err,
        hf_equals_loop=(hf == loop) if hf else None,
        logprob_diff_vs_forward=lp_diff,
    )
    if got == ref and lp_diff <= 1e-4:
        outcome = "OK"
    elif got == ref:
        outcome = "SILENT-WRONG"  # same argmax tokens, but the log-probs are off a full forward
    elif hf is None:
        outcome = "HF-FAIL"
    else:
        outcome = "SILENT-WRONG"
    if hf is not None and got != hf and got == loop:
        outcome = "OK-VS-LOOP"  # matches a cache-free forward; HF generate's own cache path differs
    return _emit(family, "generate", outcome=outcome, **rec)


def _rev():
    try:
        head = subprocess.run(
            ["git", "-C", MAIN, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", MAIN, "diff", "HEAD"], capture_output=True, text=True).stdout
        import hashlib

        return head + ("+dirty:" + hashlib.sha1(dirty.encode()).hexdigest()[:8] if dirty else "")
    except Exception:  # noqa: BLE001
        return "?"


def run_one(family):
    sys.path.insert(0, MAIN)
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from benchmarks import _tiny_configs as builder

    t0 = time.time()
    extra = {"is_decoder": True} if family in ENCODER_AS_DECODER else {}
    try:
        model = builder.build_model(family, **extra)
        vocab = builder.vocab_of(model)
        with torch.no_grad():
            model(random_sequences((7,), vocab)[0][None], use_cache=False)
    except Exception as exc:  # noqa: BLE001
        info = _classify_error(exc)
        info["outcome"] = "SKIP"
        return _emit(family, "build", **info)
    amplify = float(os.environ.get("SWEEP_AMPLIFY", "0") or 0)
    if amplify:  # sharpen the logits: a leak or a lost state shows as a larger diff and changes tokens
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(amplify)
    _emit(
        family,
        "build",
        outcome="OK",
        params=sum(p.numel() for p in model.parameters()),
        attn=model.config._attn_implementation,
        seconds=round(time.time() - t0, 1),
        cls=type(model).__name__,
        amplify=amplify,
        nopad_rev=_rev(),
    )
    _verify(model, family, "verify_flat", random_sequences((1, 37, 5, 20), vocab), tree=False)
    _verify(model, family, "verify_tree", tree_sequences(2, vocab), tree=True)
    _generate(model, family, vocab)


# ------------------------------------------------------------------------------------------- driver
def _short(rec):
    o = rec.get("outcome")
    if rec["check"] == "build" and o == "OK":
        return (
            f"{rec['cls']} {rec['params'] / 1e6:.2f}M attn={rec['attn']} {rec['seconds']}s "
            f"nopad@{rec.get('nopad_rev')}" + (f" amplify={rec['amplify']}" if rec.get("amplify") else "")
        )
    if o in ("REFUSED", "CRASH", "SKIP"):
        msg = rec["msg"]
        if rec["exc"] == "UnsupportedMixerError" and " |   - " in msg:  # the findings, not the preamble
            msg = "findings: " + " ; ".join(part.split(" | ")[0] for part in msg.split(" |   - ")[1:])
        return f"{rec['exc']}: {msg[:260]} @ {rec['raised_at']} [nopad: {rec['deepest_nopad']}]"
    if rec["check"].startswith("verify"):
        return (
            f"logit {rec['max_logit_diff']:.1e} (scale {rec['logit_scale']:.1f}) "
            f"grad {rec['grad_rel_diff']:.1e} "
            f"worst {rec['worst_tensor']:.1e} {rec['worst_param']} restored={rec['train_mode_restored']}"
        )
    if rec["check"] == "generate":
        s = f"got={rec['got']} hf={rec['hf']}"
        if rec.get("hf_error"):
            s += f" hf_error={rec['hf_error']}"
        if rec.get("hf") and not rec.get("hf_equals_loop"):
            s += f" loop={rec['loop']}"
        return s + f" lp_diff={rec['logprob_diff_vs_forward']:.1e}"
    return ""


def main(argv):
    if argv[:1] == ["--one"]:
        run_one(argv[1])
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = argv or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = [f for f in families if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        sys.exit(
            f"not a causal LM model_type of this transformers: {unknown}; choose among "
            f"{sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}"
        )
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open(RESULTS, "a") as sink:
        for family in families:
            tag = " [enc-dec decoder half]" if family in ENC_DEC_HALF else ""
            if family in SKIP:
                rec = {"family": family, "check": "build", "outcome": "SKIP", "reason": SKIP[family]}
                sink.write(json.dumps(rec) + "\n")
                print(f"{family:26s} build        SKIP  {SKIP[family]}", flush=True)
                continue
            t = time.time()
            proc = subprocess.run(
                ["timeout", str(TIMEOUT), sys.executable, __file__, "--one", family],
                capture_output=True,
                text=True,
                env=env,
                cwd=MAIN,
            )
            seen = set()
            for line in proc.stdout.splitlines():
                if not line.startswith("RESULT "):
                    continue
                rec = json.loads(line[7:])
                seen.add(rec["check"])
                sink.write(json.dumps(rec) + "\n")
                print(f"{family:26s} {rec['check']:12s} {rec['outcome']:12s} {_short(rec)}{tag}", flush=True)
            for check in ("build", "verify_flat", "verify_tree", "generate"):
                if check not in seen and not (
                    "build" in seen
                    and check != "build"
                    and any(
                        json.loads(line[7:]).get("outcome") == "SKIP"
                        for line in proc.stdout.splitlines()
                        if line.startswith("RESULT ")
                    )
                ):
                    why = "TIMEOUT" if proc.returncode == 124 else f"rc={proc.returncode}"
                    err = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else [""]
                    rec = {
                        "family": family,
                        "check": check,
                        "outcome": "CRASH",
                        "exc": why,
                        "msg": err[0][:300],
                    }
                    sink.write(json.dumps(rec) + "\n")
                    print(
                        f"{family:26s} {check:12s} CRASH        {why} {err[0][:200]} ({time.time() - t:.0f}s)",
                        flush=True,
                    )
            sink.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
