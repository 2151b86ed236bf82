"""The partner's side of the webhook, for trying the walkthrough: verifies each request and prints it.

python partner.py        # listens on $PARTNER_WEBHOOK_URL's port, checks $PARTNER_WEBHOOK_SECRET
"""

import json
import os
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import urlsplit

from outbox.integrations.webhook import WebhookVerificationError, verify

SECRET = os.environ["PARTNER_WEBHOOK_SECRET"]
PORT = urlsplit(os.environ["PARTNER_WEBHOOK_URL"]).port or 80


class Hooks(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        try:
            verify(body, self.headers, SECRET)  # the raw bytes, before any parsing
        except WebhookVerificationError as exc:
            print(f"refused: {exc}", flush=True)
            self.send_response(400)
        else:
            print(f"verified {self.headers['webhook-id']}: {json.loads(body)}", flush=True)
            self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # one line per request is enough
        pass


if __name__ == "__main__":
    print(f"partner listening on port {PORT}", flush=True)
    HTTPServer(("127.0.0.1", PORT), Hooks).serve_forever()
