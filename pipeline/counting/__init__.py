"""Token counts: the tokenizers, every count of a request and of what is emitted, image tokens, the
learned calibration of counts."""
