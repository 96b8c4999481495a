"""EAGLE-3 itself: the draft model, capture of the target's hidden states, the hidden-state store,
the draft vocabulary and speculative decoding. Libraries the extract/vocab/train/bench stages share."""
