"""Build the tiny random-weight Llama the real-vLLM stage serves, on this machine, with no hub access.

    .venv-vllm/bin/python tests/realvllm/build_tiny_model.py .cache/tiny-model

The output is deterministic (fixed corpus, fixed seed): a byte-level BPE tokenizer trained on a few
sentences, a ChatML-style chat template, and a two-layer Llama whose head_dim (32) is one that
vLLM's CPU attention backend supports. Its text is gibberish, but greedy decoding is reproducible,
which is all the P/D-equals-aggregated check needs. Runs in a few seconds with the vllm venv's
torch/transformers/tokenizers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 20260
HIDDEN_SIZE = 128
ATTENTION_HEADS = 4  # head_dim 32: the CPU backend accepts 32, 64, 80, 96, 112, 128, ... (not 16)
KV_HEADS = 2
LAYERS = 2
TOKENIZER_VOCAB = 1000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "A prefill worker computes the prompt and keeps its key and value blocks for a while.",
    "The decode worker pulls those blocks over NIXL and generates the answer token by token.",
    "Envoy buffers the request body and asks the external processor what to do with it.",
    "Streaming responses arrive as server sent events, each one a line of JSON data.",
    "Greedy sampling at temperature zero always picks the most likely next token.",
    "Four requests at once must come back as four different completions.",
    "Counting transfers on the metrics page proves the cache really moved.",
    "system user assistant message content role model prompt tokens",
    "zero one two three four five six seven eight nine ten eleven twelve",
)


def train_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(list(CORPUS) * 16, trainer)
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    return tokenizer


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(str(out))
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=LAYERS, num_attention_heads=ATTENTION_HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN_SIZE // ATTENTION_HEADS, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {out} ({parameters} parameters, vocab {vocab_size}): {sorted(os.listdir(out))}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTPUT_DIR", file=sys.stderr)
        return 2
    build(Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
