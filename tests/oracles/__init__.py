"""Reference implementations the tests compare the engines' decoders against (:mod:`.decoders`)."""
