"""Text and tokens: the tokenizer built from the model's files (chat template, special
tokens, byte pieces) and the incremental detokenizer that turns a stream's tokens into text."""
