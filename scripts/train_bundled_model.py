"""Train the bundled model, data/labkit-tiny: a ~3.5M-parameter Llama on generated children's stories.

Run from the repository root (CPU only, no network):

    python scripts/train_bundled_model.py

Expected run time: about 10-12 minutes on 2 CPU cores (the default, `--num-threads 2`). The corpus comes from
labkit.measure.corpus (seeded, offline), so the same command rebuilds the same model up to CPU floating-point
nondeterminism. Steps:

1. generate stories, multi-story documents (the shape of labkit.measure.corpus.long_text) and chat examples;
2. train a byte-level BPE tokenizer (vocab 2048) with bos/eos/pad and chat tokens, plus a Jinja chat template;
3. train LlamaForCausalLM with AdamW, linear warmup and cosine decay: mostly on 256-token sequences, then a short
   phase on 1024-token sequences so that long prompts still continue sensibly;
4. save config, safetensors weights, generation config and tokenizer to data/labkit-tiny/, then print greedy
   continuations of a few in-domain prompts.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout, not installed
from labkit.measure import corpus  # noqa: E402

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *CHAT_TOKENS]  # ids 0..6: pad=0, bos=1, eos=2 as in Llama

# Each turn is "<|role|>\n{content}<|end|>\n"; the prompt for a reply ends with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown role: ' + message['role'] + ' (expected system, user or assistant)') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


@dataclass
class TrainConfig:
    out_dir: str = "data/labkit-tiny"
    seed: int = 0
    num_threads: int = 2
    # corpus
    num_stories: int = 24000
    num_multi_story_docs: int = 1500  # 2-5 stories joined by blank lines, like corpus.long_text
    num_chats: int = 4000
    vocab_size: int = 2048
    # model
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    # optimisation: phase 1 on short sequences, phase 2 on long ones; one LR schedule over both
    short_steps: int = 900
    short_seq_len: int = 256
    short_batch_size: int = 8  # 8x256 is faster per token than 16x256 on 2 CPU cores (cache-friendly)
    long_steps: int = 80
    long_seq_len: int = 1024
    long_batch_size: int = 4
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: any text round-trips through encode/decode; encoding with special tokens prepends <s>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # maps "Ġ" etc. back to spaces and bytes
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte: no <unk>
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   extra_special_tokens=CHAT_TOKENS, chat_template=CHAT_TEMPLATE,
                                   model_max_length=2048, clean_up_tokenization_spaces=False)


def build_documents(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast | None) -> list[str]:
    """Training documents as text: stories, multi-story texts, and chats rendered through the chat template."""
    rng = random.Random(cfg.seed)
    docs = corpus.generate_stories(cfg.num_stories, seed=cfg.seed)
    for i in range(cfg.num_multi_story_docs):
        docs.append("\n\n".join(corpus.generate_stories(rng.randint(2, 5), seed=cfg.seed + 1_000_000 + i)))
    chats = corpus.chat_examples(cfg.num_chats, seed=cfg.seed + 1)
    if tokenizer is None:  # tokenizer training: the chat tokens are already in its vocabulary
        docs += [m["content"] for chat in chats for m in chat]
    else:
        docs += [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
    rng.shuffle(docs)
    return docs


def pack(docs: list[list[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Pack `<s> doc </s>` sequences into rows of seq_len tokens; each row starts at a document start
    (as a prompt does), and the document that overflows a row is cut (data is cheap, positions matter)."""
    rows: list[list[int]] = []
    row: list[int] = []
    for ids in docs:
        row += ids + [eos_id]
        if len(row) >= seq_len:
            rows.append(row[:seq_len])
            row = []
    return torch.tensor(rows, dtype=torch.long)  # (num_rows, seq_len)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig) -> None:
    t0 = time.time()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(True)

    tokenizer = build_tokenizer(build_documents(cfg, None), cfg.vocab_size)
    docs = build_documents(cfg, tokenizer)
    # Chat documents start with <s> from the template; drop it so the post-processor adds <s> to every document.
    token_docs = tokenizer([d.removeprefix(BOS) for d in docs], add_special_tokens=True)["input_ids"]
    print(f"{len(docs)} documents, {sum(map(len, token_docs)):,} tokens, vocab {len(tokenizer)}, "
          f"{time.time() - t0:.0f}s")

    mcfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # transformers 5 keeps rope_theta here
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    model = LlamaForCausalLM(mcfg)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters")

    # Hold out a few documents for a validation loss; phase 1 uses the first part, phase 2 the rest.
    val_rows = pack(token_docs[:200], cfg.short_seq_len, tokenizer.eos_token_id)
    split = 200 + int((len(token_docs) - 200) * 0.75)
    short_rows = pack(token_docs[200:split], cfg.short_seq_len, tokenizer.eos_token_id)
    long_rows = pack(token_docs[split:], cfg.long_seq_len, tokenizer.eos_token_id)
    need = (cfg.short_steps * cfg.short_batch_size, cfg.long_steps * cfg.long_batch_size)
    print(f"rows: {len(short_rows)} x {cfg.short_seq_len} (need {need[0]}), "
          f"{len(long_rows)} x {cfg.long_seq_len} (need {need[1]})")

    decay = [p for p in model.parameters() if p.dim() >= 2]  # no weight decay on norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    total = cfg.short_steps + cfg.long_steps
    phases = [(short_rows, cfg.short_batch_size, cfg.short_steps), (long_rows, cfg.long_batch_size, cfg.long_steps)]
    model.train()
    step, loss_ema = 0, float("nan")
    bar = tqdm(total=total, desc="train")
    for rows, batch_size, steps in phases:
        order = torch.randperm(len(rows), generator=gen)
        for i in range(steps):
            idx = order[(i * batch_size) % len(rows):][:batch_size]
            x = rows[idx]  # (B, T); labels are shifted inside the model
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, cfg)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            loss_ema = loss.item() if step == 0 else 0.95 * loss_ema + 0.05 * loss.item()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}", T=x.shape[1])
            if step % 100 == 0 or step == total:
                tqdm.write(f"step {step}/{total}  seq_len {x.shape[1]}  loss {loss.item():.3f}  (ema {loss_ema:.3f})")
    bar.close()

    model.eval()
    with torch.no_grad():
        val_loss = sum(model(input_ids=val_rows[i:i + 8], labels=val_rows[i:i + 8]).loss.item()
                       for i in range(0, len(val_rows), 8)) / math.ceil(len(val_rows) / 8)
    train_s = time.time() - t0
    print(f"final train loss (ema) {loss_ema:.3f}, validation loss {val_loss:.3f}, wall time {train_s / 60:.1f} min")

    # Greedy decoding ends at </s>, or at <|end|> after a chat reply.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")], max_new_tokens=256)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved to {out}/: {', '.join(sorted(p.name for p in out.iterdir()))}")

    prompts = corpus.story_prompts(2, seed=123)
    prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story about a dog."}],
                                                 tokenize=False, add_generation_prompt=True))
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=not prompt.startswith(BOS), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen_ids = model.generate(ids, max_new_tokens=80, do_sample=False)
        print(f"\n--- prompt: {prompt!r}\n{tokenizer.decode(gen_ids[0, ids.shape[1]:], skip_special_tokens=True)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(TrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    train(TrainConfig(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
