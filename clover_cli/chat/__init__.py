"""`clover chat`: conversation.py (the messages and what the slash commands do to them), commands.py (the chat: its
replies and slash commands), repl.py (the terminal: prompt-toolkit's loop, piped input, start-up)."""

from .repl import run_chat

__all__ = ["run_chat"]
