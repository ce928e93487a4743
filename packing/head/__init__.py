"""The LM head, written once for the trainer and the generator: hidden states -> the log-prob of a
chosen token (and the entropy), chunked so a packed row never holds its ``T x V`` logits.

- :mod:`~nopad.packing.head.chunked`: the head over any model (:func:`token_logprobs`);
- :mod:`~nopad.packing.head.model_head`: the model's head module and final-logit ops (:class:`LMHead`);
- :mod:`~nopad.packing.head.linear`: its hand-written gradients for a plain ``nn.Linear`` head;
- :mod:`~nopad.packing.head.log_softmax`: the log-softmax kernels the head and the sampler share.
"""
