"""What the engine knows of the forward pass running now, and how it reads a layer's inputs.

forward_pass.py  ForwardPass: decode or prefill, rows, mask, token kinds, look-ahead (one per model call)
layer_state.py   LayerState: what a predictor reads at a sparse layer (router input, residual, routing)
input_taps.py    reading a module's input on the hot path without a forward pre-hook
token_kinds.py   which tokens are image tokens and which text, for metrics by token kind
"""
