"""Chat templates: the role fragments a tokenizer's own template renders, and the codec built from them.

A template is rendered around sentinel contents and split on them, so any template that renders a
conversation as a growing prefix gives its opening and closing text per role (docs/pml-spec.md).
"""

from __future__ import annotations

from engine.errors import ModelError
from engine.model.sanity import short
from engine.model.tokens import CachedEncode
from engine.schema.layout import TextCodec

SENTINELS = {"system": "PMLSENTINELSYSTEM", "user": "PMLSENTINELUSER", "assistant": "PMLSENTINELASSISTANT"}


def make_codec(tokenizer, max_positions: int, fingerprint: str) -> TextCodec:
    """The TextCodec of ``tokenizer``: its encoder (each document tokenized once, :class:`CachedEncode`) and the
    role ids its template renders."""

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    encode = CachedEncode(tokenize)

    auto = tokenizer("a").input_ids
    plain = encode("a")
    bos = tuple(auto[: len(auto) - len(plain)]) if auto[-len(plain):] == plain else ()
    role_open: dict[str, tuple[int, ...]] = {}
    role_close: dict[str, tuple[int, ...]] = {}
    generation: tuple[int, ...] = ()
    error = ""
    try:
        texts, gen_text, template_bos = chat_fragments(tokenizer)
        if template_bos:
            bos = tuple(encode(template_bos))
        for role, (o, c) in texts.items():
            role_open[role] = tuple(encode(o))
            role_close[role] = tuple(encode(c))
        generation = tuple(encode(gen_text))
    except ModelError as err:
        error = str(err)
    placeholder = next(t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                       if t is not None)
    return TextCodec(encode=encode, role_open=role_open, role_close=role_close, generation_prompt=generation,
                     bos=bos, placeholder=placeholder, max_positions=max_positions, fingerprint=fingerprint,
                     roles_error=error)


def chat_fragments(tokenizer) -> tuple[dict[str, tuple[str, str]], str, str]:
    """({role: (opening, closing)}, generation prompt, template BOS text)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the loaded model has no chat template, so <system>/<user>/<assistant> cannot be compiled")
    s, u, a = (SENTINELS[r] for r in ("system", "user", "assistant"))

    def render(msgs, gen=False) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as err:
            raise ModelError(f"the model's chat template failed to render: {short(err)}") from None

    sys_msg = {"role": "system", "content": s}
    user_msg = {"role": "user", "content": u}
    asst_msg = {"role": "assistant", "content": a}
    r1 = render([sys_msg])
    r2 = render([sys_msg, user_msg])
    r3 = render([sys_msg, user_msg, asst_msg])
    r2g = render([sys_msg, user_msg], gen=True)
    if not (r2.startswith(r1) and r3.startswith(r2) and r2g.startswith(r2)):
        raise ModelError("the model's chat template does not render conversations as a growing prefix; "
                         "role tags cannot be compiled for it")
    user_open, user_close = r2[len(r1):].split(u)
    # Llama 3's <|begin_of_text|> opens the document once; a ChatML "BOS" (<|im_start|>) opens every turn
    bos_text = getattr(tokenizer, "bos_token", None) or ""
    template_bos = bos_text if bos_text and r1.startswith(bos_text) and not user_open.startswith(bos_text) else ""
    sys_open, sys_close = r1[len(template_bos):].split(s)
    asst_open, asst_close = r3[len(r2):].split(a)
    gen = r2g[len(r2):]
    return ({"system": (sys_open, sys_close), "user": (user_open, user_close),
             "assistant": (asst_open, asst_close)}, gen, template_bos)
