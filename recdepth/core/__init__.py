"""What every feature folder shares: the registry of named extension points and the
runtime's facts (torch and numpy only). The module map is docs/layout.md."""
