"""Reference engine figures: logits vs transformers, memory around release/resume, time per token.

Run: PYTHONPATH=. .venv/bin/python dev/measure_engine.py [recipe]   (default: small)
Prints one JSON object per TP size.
"""
import json, sys, time
import torch
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.models import build_model, load_config, count_params

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7], [300, 301, 302, 5, 6, 7, 8]]

def mib(x): return round(x / 2**20, 2)

if __name__ == "__main__":
    recipe = sys.argv[1] if len(sys.argv) > 1 else "small"
    cfg = load_config(recipe)
    model = build_model(cfg, seed=0).eval()
    torch.set_num_threads(2)
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        ref_all = [model(input_ids=torch.tensor([p])).logits[0] for p in PROMPTS]
    named = list(model.state_dict().items())
    for tp in (1, 2):
        t0 = time.perf_counter()
        with ReferenceEngine(model_config=cfg, tp_size=tp, kv_cache_tokens=2048) as e:
            startup = time.perf_counter() - t0
            t0 = time.perf_counter(); e.update_weights_from_tensor(named); load_s = time.perf_counter() - t0
            diff = float((e.forward_logits(PROMPTS) - ref).abs().max())
            diff_all = max(float((a - b).abs().max()) for a, b in zip(e.forward_logits(PROMPTS, all_positions=True), ref_all))
            e.generate(PROMPTS, 4)   # warm-up
            times = []
            for _ in range(3):
                t0 = time.perf_counter(); out = e.generate(PROMPTS, 32); times.append(time.perf_counter() - t0)
            best = min(times)
            before = e.memory_stats()
            e.release_memory_occupation(["kv_cache"]); after_kv = e.memory_stats()
            e.release_memory_occupation(["weights"]); after_w = e.memory_stats()
            e.resume_memory_occupation(); resumed = e.memory_stats()
            row = {
                "recipe": recipe, "params": count_params(model)[0], "tp": tp, "startup_s": round(startup, 2),
                "load_hf_tensors_s": round(load_s, 3),
                "max_abs_logit_diff_last": diff, "max_abs_logit_diff_all_positions": diff_all,
                "generate_4x32_s": round(best, 3), "ms_per_decode_step": round(best / 32 * 1e3, 2),
                "ms_per_generated_token": round(best / (32 * len(PROMPTS)) * 1e3, 2),
                "weights_MiB": mib(before["weights_bytes"]), "kv_cache_MiB": mib(before["kv_cache_bytes"]),
                "rss_MiB": {"before": mib(before["rss"]), "after_kv_release": mib(after_kv["rss"]),
                            "after_weights_release": mib(after_w["rss"]), "after_resume": mib(resumed["rss"])},
                "uss_MiB": {"before": mib(before["uss"]), "after_kv_release": mib(after_kv["uss"]),
                            "after_weights_release": mib(after_w["uss"]), "after_resume": mib(resumed["uss"])},
            }
            rel = before["weights_bytes"] + before["kv_cache_bytes"]
            row["rss_drop_over_released"] = round((before["rss"] - after_w["rss"]) / rel, 3)
            row["uss_drop_over_released"] = round((before["uss"] - after_w["uss"]) / rel, 3)
            print(json.dumps(row))
