"""`localserve tray`: the desktop icon. `state.py` reads the daemon over HTTP, `menu.py` turns that
state into a menu (a pure function, tested without a display), `icon.py` draws the icon,
`actions.py` does what the items say, and `app.py` wires them into pystray."""
