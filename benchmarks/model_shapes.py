"""Parameter shapes of real models, built from their configurations (no weights, no transformers).

Each set is a list of (name, shape) in the order the model's ``parameters()`` lists them, which is
the order an optimizer built from it (and so ``ampx.GradScaler`` and ``ampx.GradBuffer``) sees:

  gpt2         GPT-2 124M: 12 layers, d=768, vocab 50,257, 1,024 positions; the LM head is tied
               to the token embedding (no parameter of its own): 148 tensors, 124.4M elements.
  gpt2-medium  the 350M decoder (GPT-2 medium): 24 layers, d=1024: 292 tensors, 354.8M elements.
  lora         LoRA rank 8 on every linear of a 24-layer decoder with d=1024 (q, k, v, o, fc1
               1024->4096, fc2 4096->1024): A (8, in) and B (out, 8) each, the base weights frozen
               and absent: 288 tensors, 3.5M elements.

``quick=True`` gives the same structure scaled down (for smoke runs): fewer layers, a narrower
model, a small vocabulary.
"""

__all__ = ["SETS", "shape_set", "numel"]


def gpt2(n_layer, d, vocab=50257, n_ctx=1024):
    """GPT-2's parameters (Hugging Face's GPT2LMHeadModel order; Conv1D weights are (in, out))."""
    out = [("wte.weight", (vocab, d)), ("wpe.weight", (n_ctx, d))]
    for i in range(n_layer):
        h = f"h.{i}."
        out += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return out


def lora(n_layer, d, rank=8, ffn=4):
    """LoRA adapters (A: (rank, in), B: (out, rank)) on each linear of each layer."""
    linears = [("q", d, d), ("k", d, d), ("v", d, d), ("o", d, d), ("fc1", d, ffn * d), ("fc2", ffn * d, d)]
    out = []
    for i in range(n_layer):
        for name, fan_in, fan_out in linears:
            p = f"layers.{i}.{name}."
            out += [(p + "lora_A", (rank, fan_in)), (p + "lora_B", (fan_out, rank))]
    return out


SETS = {
    "gpt2": ("GPT-2 124M", lambda q: gpt2(2, 256, 4096, 256) if q else gpt2(12, 768)),
    "gpt2-medium": ("GPT-2 medium 350M", lambda q: gpt2(4, 256, 4096, 256) if q else gpt2(24, 1024)),
    "lora": ("LoRA r=8, 24 layers, d=1024", lambda q: lora(4, 256) if q else lora(24, 1024)),
}


def shape_set(key, quick=False):
    """(title, [(name, shape), ...]) of one set."""
    title, build = SETS[key]
    return (title + (" (--quick: scaled down)" if quick else "")), build(quick)


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    for key in SETS:
        title, shapes = shape_set(key)
        print(f"{key:<12} {title:<30} {len(shapes):5d} tensors {sum(numel(s) for _, s in shapes) / 1e6:8.1f}M elements")
