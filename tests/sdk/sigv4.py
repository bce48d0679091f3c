"""A real AWS SigV4 signature (botocore, offline, fake credentials) on a Bedrock InvokeModel request.

`sigv4.py send`: signs the request for bedrock-runtime.us-east-1.amazonaws.com and sends it through HTTPS_PROXY,
trusting SSL_CERT_FILE (as `llmtap run` sets them); prints one JSON object: the status, the answer's body and
the headers it signed.
`sigv4.py verify`: reads a received request as JSON on stdin ({method, host, path, headers: [[name, value]],
body}) and recomputes its signature from those bytes, as AWS does: the headers named in SignedHeaders, the
timestamp of x-amz-date. Prints {"valid": bool, "signature": received, "expected": recomputed}."""
import json
import os
import sys

import urllib3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

HOST = "bedrock-runtime.us-east-1.amazonaws.com"
PATH = "/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/invoke"
BODY = json.dumps(
    {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
).encode()
# Fake credentials: the test's upstream knows them (as AWS knows the real ones). The secret marks the store scan.
CREDS = Credentials("AKIDEXAMPLE", "SIGV4SECRET-wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")


def signer():
    return SigV4Auth(CREDS, "bedrock", "us-east-1")


def send():
    req = AWSRequest(method="POST", url=f"https://{HOST}{PATH}", data=BODY,
                     headers={"content-type": "application/json", "accept": "application/json"})
    signer().add_auth(req)
    headers = dict(req.headers.items())
    proxy = urllib3.ProxyManager(os.environ["HTTPS_PROXY"], ca_certs=os.environ["SSL_CERT_FILE"], retries=False)
    r = proxy.request("POST", f"https://{HOST}{PATH}", body=BODY, headers=headers)
    print(json.dumps({"status": r.status, "body": r.data.decode(), "signed": headers}))


def verify():
    got = json.load(sys.stdin)
    headers = {k.lower(): v for k, v in got["headers"]}
    auth = headers["authorization"]
    fields = dict(part.strip().split("=", 1) for part in auth.split(" ", 1)[1].split(","))
    signed_names = fields["SignedHeaders"].split(";")
    req = AWSRequest(method=got["method"], url=f"https://{got['host']}{got['path']}", data=got["body"].encode(),
                     headers={k: headers[k] for k in signed_names if k != "host"})
    s = signer()
    req.context["timestamp"] = headers["x-amz-date"]
    s._modify_request_before_signing(req)
    canonical = s.canonical_request(req)
    expected = s.signature(s.string_to_sign(req, canonical), req)
    same_names = ";".join(sorted(signed_names)) == s.signed_headers(s.headers_to_sign(req))
    print(json.dumps({"valid": expected == fields["Signature"] and same_names,
                      "signature": fields["Signature"], "expected": expected}))


{"send": send, "verify": verify}[sys.argv[1]]()
