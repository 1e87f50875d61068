"""Audio in and out of the speech models: decoding uploads, encoding speech, subtitle text."""
