"""Adapters that hand a training framework's own trainer to ft_launcher without editing it.

Each module imports its framework only when its `install()` is called: `import ft_launcher` and
`import ft_launcher.integrations` import nothing of any framework. torchtitan: sections around its
trainer's setup, steps and checkpointing, and its checkpointer's states as a LiveState.
"""
