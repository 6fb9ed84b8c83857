"""What decides a row's next token beyond the model: sampling, constraints, choices, reasoning
and speculation. They import only the engine's base, the kernels and each other."""
