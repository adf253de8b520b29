"""llama.cpp-exact tokenization from a GGUF file's own metadata, plus sandboxed chat templates.

>>> from alchemist.tokenizer import load_tokenizer
>>> tok = load_tokenizer("model.gguf")
>>> ids = tok.encode("Hello")  # == llama.cpp llama_tokenize(text, add_special=True, parse_special=True)
>>> text = tok.decode(ids)  # == llama.cpp llama_detokenize(ids, remove_special=False, unparse_special=True)
>>> prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])  # sandboxed jinja2
>>> for chunk in map(tok.stream_decoder().feed, ids): ...  # never half a UTF-8 character
"""

from alchemist.tokenizer.tokenizer import StreamDecoder, Tokenizer, load_tokenizer
from alchemist.tokenizer.vocab import Vocab, read_vocab

__all__ = ["StreamDecoder", "Tokenizer", "Vocab", "load_tokenizer", "read_vocab"]
