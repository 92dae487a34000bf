"""How long cutting a model into blocks takes (it runs in every rank of every trial), per family; the export-based
alternative (torch.distributed.pipelining.pipeline() with SplitPoint) on the same Llama for comparison; and what
the Hugging Face stages' per-forward context costs against the model's own forward.

cold: a fresh process, build the model, first cut_model (what a rank pays; torch/transformers import excluded).
warm: median of --repeats further cut_model calls on the same model in that process.

    python bench/cut_model.py --repeats 5      # needs transformers, timm, torchvision (pip install -e ".[models]")
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {
    "sequential (13 layers)": "mlp",
    "hf Llama, 4 layers": "llama4",
    "hf Llama, 32 layers": "llama32",
    "hf GPT-2, 12 layers": "gpt2",
    "timm ViT-Tiny, 12 blocks": "vit",
    "torchvision ResNet-18": "resnet18",
    "traced (skip connections, 24 blocks)": "skip",
}


def build(kind: str) -> tuple[Any, Any]:
    """(model, inputs) for one kind, small widths: cutting cost depends on structure, not width."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(64, 64), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(64, 8)), torch.randn(2, 64)
    if kind.startswith("llama"):
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=int(kind[5:]), num_attention_heads=4, num_key_value_heads=2)
        ids = torch.randint(0, 256, (2, 32))
        return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "gpt2":
        import transformers

        cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=12, n_head=4, bos_token_id=0, eos_token_id=0)
        ids = torch.randint(0, 256, (2, 32))
        return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "vit":
        import timm

        net = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10)
        return net, torch.randn(2, 3, 64, 64)
    if kind == "resnet18":
        import torchvision

        return torchvision.models.resnet18(weights=None, num_classes=10), torch.randn(2, 3, 64, 64)
    if kind == "skip":
        class Skip(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Linear(16, 32)
                self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(22))
                self.head = nn.Linear(32, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h0 = h = self.embed(x)
                for layer in self.layers:
                    h = torch.tanh(layer(h)) + h0
                return self.head(h)

        return Skip(), torch.randn(2, 16)
    raise ValueError(kind)


def child(kind: str, repeats: int) -> dict[str, Any]:
    """Runs in a fresh process: cold and warm cut_model times, and the time of building every stage of a 2-way cut."""
    from autotune.models import cut_model

    model, inputs = build(kind)
    start = time.perf_counter()
    blocks = cut_model(model, inputs=inputs)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        cut_model(model, inputs=inputs)
        warm.append(time.perf_counter() - start)
    start = time.perf_counter()
    half = blocks.n_blocks // 2
    blocks.stage(0, half), blocks.stage(half, blocks.n_blocks)
    stages = time.perf_counter() - start
    return {"family": blocks.family, "blocks": blocks.n_blocks, "cold_ms": cold * 1e3,
            "warm_ms": statistics.median(warm) * 1e3, "stages_ms": stages * 1e3}


def child_export(repeats: int) -> dict[str, Any]:
    """torch's export-based frontend on the 4-layer Llama, a split point before every layer and the norm."""
    import torch
    from torch.distributed.pipelining import SplitPoint, pipeline

    model, inputs = build("llama4")

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def once() -> float:
        wrapped = Logits()
        spec = {f"m.model.layers.{i}": SplitPoint.BEGINNING for i in range(4)}
        spec["m.model.norm"] = SplitPoint.BEGINNING
        start = time.perf_counter()
        pipeline(wrapped, (inputs["input_ids"], inputs["attention_mask"]), split_spec=spec)
        elapsed = time.perf_counter() - start
        for name in spec:  # pipeline() patches the modules' forward in place: undo it
            module = wrapped.get_submodule(name)
            del module.forward
        return elapsed

    cold = once()
    warm = [once() for _ in range(repeats)]
    return {"family": "export (pipeline + SplitPoint)", "blocks": 6, "cold_ms": cold * 1e3,
            "warm_ms": statistics.median(warm) * 1e3, "stages_ms": None}


def child_overhead(repeats: int) -> dict[str, Any]:
    """A 4-layer Llama (hidden 256, seq 256, batch 4): forward+backward of the model itself, of the blocks in one
    stage, and of the blocks as 4 chained stages (each recomputes mask and rotary embeddings)."""
    import torch
    import transformers

    from autotune.models import cut_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1024, (4, 256))
    mask = torch.ones_like(ids)
    mask[0, :50] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    blocks = cut_model(model)
    args, side = blocks.split_inputs(inputs)
    one = blocks.stage(0, blocks.n_blocks)
    bounds = [0, 2, 3, 4, blocks.n_blocks]
    four = [blocks.stage(a, b) for a, b in zip(bounds, bounds[1:])]

    def own() -> None:
        model(**inputs).logits.sum().backward()

    def single() -> None:
        one(*args, **side).sum().backward()

    def chained() -> None:
        x: Any = args
        for stage in four:
            x = (stage(*x, **side),)
        x[0].sum().backward()

    times: dict[str, list[float]] = {"own": [], "one stage": [], "4 stages": []}
    for _ in range(repeats + 1):
        for name, fn in (("own", own), ("one stage", single), ("4 stages", chained)):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fn = {"export": lambda: child_export(args.repeats), "overhead": lambda: child_overhead(args.repeats)}
        result = fn[args.child]() if args.child in fn else child(args.child, args.repeats)
        print(json.dumps(result))
        return

    def run(kind: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True, cwd=ROOT)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows, data = [], {}
    for label, kind in [*FAMILIES.items(), ("generic export path, hf Llama 4 layers", "export")]:
        r = run(kind)
        data[label] = r
        rows.append([label, r["family"], r["blocks"], r["cold_ms"], r["warm_ms"],
                     "—" if r["stages_ms"] is None else r["stages_ms"]])
    overhead = run("overhead")
    data["overhead_ms"] = overhead
    tables = {
        "cut_model": _results.markdown_table(
            ["model", "family", "blocks", "cold ms", "warm ms", "2 stages built, ms"], rows),
        "HF stage overhead (Llama 4 layers, hidden 256, seq 256, batch 4, forward + backward, 1 thread)":
            _results.markdown_table(["run", "ms"], [[k, v] for k, v in overhead.items()]),
    }
    _results.write("cut_model", title="Cutting models into blocks", device="cpu", tables=tables, data=data)


if __name__ == "__main__":
    main()
