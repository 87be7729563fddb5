"""The browser chat page (index.html, app.js, style.css): package data, served by streamengine.server.app."""
