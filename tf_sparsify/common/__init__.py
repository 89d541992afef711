"""What every layer shares and nothing else: argument checks and the dtype lists."""
