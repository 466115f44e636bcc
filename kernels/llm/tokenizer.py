"""The real model's tokenizer, built from the GGUF file: byte-level BPE plus the chat template.

llama.cpp's "smollm" pre-tokenizer rule: every digit is its own piece ("2024" -> 2, 0, 2, 4)
before the byte-level split; the file names the rule (tokenizer.ggml.pre = "smollm") but does
not spell it out, so it is written here. transformers' own GGUF loader leaves it out.
"""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3  # tokenizer.ggml.token_type of a special token (<|im_start|>, <|endoftext|>, ...)


class ChatTokenizer:
    """encode(text) / decode(ids) / chat(user_message) over one `tokenizers.Tokenizer`."""

    def __init__(self, tokens, merges, token_types, chat_template, eos_id):
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
        )
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, kind in zip(tokens, token_types, strict=True) if kind == CONTROL]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self._tok = tok
        self.chat_template = chat_template
        self.eos_id = eos_id
        self.vocab_size = len(tokens)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def chat_text(self, user_message: str) -> str:
        """The prompt the file's chat template makes for one user message, ready for a reply."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = ImmutableSandboxedEnvironment().from_string(self.chat_template)
        messages = [{"role": "user", "content": user_message}]
        return template.render(messages=messages, add_generation_prompt=True)

    def chat(self, user_message: str) -> list[int]:
        return self.encode(self.chat_text(user_message))


class ByteTokenizer:
    """UTF-8 bytes as token ids, for the random-weight "tiny" config (vocabulary 256)."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def chat(self, user_message: str) -> list[int]:
        return self.encode(f"User: {user_message}\nAssistant:")


def from_metadata(metadata) -> ChatTokenizer:
    """The tokenizer from `weights.read_gguf`'s metadata."""
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    if (model, pre) != ("gpt2", "smollm"):
        raise ValueError(
            "this tokenizer implements byte-level BPE with the 'smollm' digit rule; the file "
            f"has model {model!r}, pre {pre!r}"
        )
    return ChatTokenizer(
        tokens=metadata["tokenizer.ggml.tokens"],
        merges=metadata["tokenizer.ggml.merges"],
        token_types=metadata["tokenizer.ggml.token_type"],
        chat_template=metadata["tokenizer.chat_template"],
        eos_id=metadata["tokenizer.ggml.eos_token_id"],
    )
