"""What every layer shares and nothing else: argument checks, the dtype lists, and
AutoGraph's rule for the package."""
