"""A Triton backend named "cpu" for Triton's interpreter (TRITON_INTERPRET=1): it compiles
nothing and refuses to be asked to."""
