"""The inference server seen from outside: SGLang launch argv and SGLang log parsing (the console
imports the log parser for the board's live server line)."""
