"""What turns packed rows into a training step (see the README's layout table)."""
