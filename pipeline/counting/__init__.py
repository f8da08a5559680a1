"""Token counts: the tokenizers, every count of a request and of what is emitted, image sizes and their
stubs, image tokens, the learned calibration of counts."""
