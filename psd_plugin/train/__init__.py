"""Making the embedded models: the generated task corpus and its held-out split (:mod:`.tasks`) and the
training script (:mod:`.trainer`, ``psd train`` / ``python -m psd_plugin.train``). Nothing here is imported
by the serving path."""
