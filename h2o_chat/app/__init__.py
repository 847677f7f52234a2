"""The application: Typer commands, the chat session (turn loop, slash commands, view), conversations, batch
runs, and rich rendering. The top layer: it wires the others together and renders what they return.
"""
