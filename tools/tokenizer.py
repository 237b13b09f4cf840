"""The byte-level BPE tokenizer every tiny model shares, trained here offline.

Llama-3-style special tokens and chat template, trained on a few built-in
sentences; a model adds its own special tokens (``<image>``, ``<|image|>``, ...)
on top, after the shared ones, so that the shared ids are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VOCAB_SIZE = 640  # BPE target; the trained vocabulary ends up at most this size

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]

# Llama-3-like: every message is "<|start_header_id|>role<|end_header_id|>\n\n
# content<|eot_id|>"; the generation prompt opens an assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A small language model can still produce text one token at a time.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "She opened the window to let the cool morning air into the room.",
    "Every good test checks one behaviour and explains what went wrong.",
    "The train to the mountains leaves at seven o'clock every evening.",
    "We planted tomatoes, beans and sunflowers in the garden this spring.",
    "Numbers like 3, 14, 159 and 2653 appear in many simple examples.",
    "He wrote a short letter to his grandmother and posted it on Monday.",
    "The library closes early on weekends, so bring your books back soon.",
    "Clouds gathered over the hills before the first drops of rain fell.",
    "A careful engineer measures twice and changes the code only once.",
    "The cat slept on the warm windowsill while the kettle boiled.",
    "Ships carry containers across the ocean from one harbour to another.",
    "Please answer the question in a single clear and friendly sentence.",
    "Hello! How are you today? I am fine, thank you for asking.",
    "What is the weather like in London during the month of November?",
    "The orchestra played a quiet piece before the long final symphony.",
    "Bread, cheese, apples and water were packed for the long walk.",
    "Memory is divided into blocks, and each block holds a few tokens.",
    "The teacher asked the students to read the third chapter aloud.",
    "Bright stars filled the night sky above the silent desert camp.",
    "Our team meets every Tuesday to review progress and plan the week.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The museum shows paintings, old maps and a very large clock.",
    "If the server is healthy, it answers requests within a second.",
    "Birds sang in the trees as the sun rose over the quiet village.",
    "Write a poem about the sea, the wind and a small wooden boat.",
    "The recipe needs two eggs, a cup of flour and a pinch of salt.",
    "Tomorrow we will travel north by car and stop for lunch on the way.",
    "The user asked a question and the assistant gave a short reply.",
    "Good morning, everyone; let us begin with a brief summary.",
]


def build_tokenizer(
    added_tokens: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
    plain_tokens: Sequence[str] = (),
    named_tokens: Mapping[str, str] | None = None,
) -> Any:
    """Train the tokenizer, wrap it as a fast HF tokenizer, add ``added_tokens``
    (special, not normalised), then ``plain_tokens`` (whole-string tokens that are
    not special: decoding keeps them), and set ``chat_template``.

    ``named_tokens``: attribute name -> token (``{"boi_token": "<start_of_image>"}``),
    saved as the tokenizer's ``extra_special_tokens``: processors read
    ``tokenizer.boi_token`` / ``tokenizer.boi_token_id``. Each must be one of
    ``added_tokens``."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    # Like Llama 3: encoding with special tokens prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    named = dict(named_tokens or {})
    unknown = sorted(set(named.values()) - set(added_tokens))
    assert not unknown, f"named tokens not among the added tokens: {unknown}"
    extra: dict[str, Any] = {"extra_special_tokens": named} if named else {}
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[EOS, START_HEADER, END_HEADER],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
        **extra,
    )
    base = tok.get_vocab_size()
    hf_tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in added_tokens],
        special_tokens=True,
    )
    # New ids, one each (named tokens were registered by the constructor already).
    ids = hf_tok.convert_tokens_to_ids(list(added_tokens))
    new_ids = set(ids if isinstance(ids, list) else [ids])
    assert len(new_ids) == len(added_tokens) and min(new_ids, default=base) >= base, (
        f"tokens already known: {added_tokens}"
    )
    if plain_tokens:
        added = hf_tok.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in plain_tokens]
        )
        assert added == len(plain_tokens), f"tokens already known: {plain_tokens}"
    hf_tok.chat_template = chat_template
    return hf_tok


# The text template with image content parts rendered as ``image_token``.
_TEXT_PART = "{% if part['type'] == 'text' %}"


def image_chat_template(image_token: str) -> str:
    """``CHAT_TEMPLATE`` writing ``image_token`` where a message has an image part."""
    assert _TEXT_PART in CHAT_TEMPLATE
    return CHAT_TEMPLATE.replace(
        _TEXT_PART,
        "{% if part['type'] == 'image' %}{{ '" + image_token + "' }}"
        "{% elif part['type'] == 'text' %}",
    )
