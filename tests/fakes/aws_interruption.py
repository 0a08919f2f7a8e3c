"""A moto server that can also be told that AWS took a spot instance back (issue 13's
recovery tests): a TerminateInstances carrying :data:`HEADER` (its value: EC2's state-reason
code, e.g. ``Server.SpotInstanceTermination``) is not the API terminating the instance but
EC2 interrupting it: the instance is terminated with that state reason, as DescribeInstances
shows after a spot interruption. Everything else is :func:`aws_moto.serve_moto`.

    python -c "import sys; sys.path.insert(0, FAKES); import aws_interruption; \\
               aws_interruption.serve(PORT)"
"""

from __future__ import annotations

from typing import Any

HEADER = "X-Ct-Spot-Interruption"


def patch_interruption() -> None:
    from moto.core.responses import ActionResult
    from moto.ec2.models.instances import StateReason
    from moto.ec2.responses.instances import InstanceResponse

    terminate = InstanceResponse.terminate_instances

    def terminate_instances(self: Any) -> Any:
        code = self.headers.get(HEADER)
        if code is None:
            return terminate(self)
        out = []
        for iid in self._get_param("InstanceIds", []):
            inst = self.ec2_backend.get_instance(iid)
            previous = inst.terminate()
            inst.state_reason = StateReason(f"{code}: Spot instance interrupted", code)
            out.append({"InstanceId": iid,
                        "CurrentState": {"Code": inst._state.code, "Name": inst._state.name},
                        "PreviousState": {"Code": previous.code, "Name": previous.name}})
        return ActionResult({"TerminatingInstances": out})

    InstanceResponse.terminate_instances = terminate_instances


def serve(port: int, host: str = "127.0.0.1") -> None:
    """aws_moto's server (moto imported only after it set the AMIs up), with the
    interruption added once its own patches are in."""
    import aws_moto

    patch = aws_moto.patch_moto_server

    def both(*args: Any, **kw: Any) -> Any:
        out = patch(*args, **kw)
        patch_interruption()
        return out

    aws_moto.patch_moto_server = both
    aws_moto.serve_moto(host, port)


def interrupt(ec2: Any, instance_id: str,
              code: str = "Server.SpotInstanceTermination") -> None:
    """With a boto3 EC2 client of that server: AWS takes the instance back."""
    def mark(request: Any, **_: Any) -> None:
        request.headers[HEADER] = code

    ec2.meta.events.register("before-sign.ec2.TerminateInstances", mark)
    try:
        ec2.terminate_instances(InstanceIds=[instance_id])
    finally:
        ec2.meta.events.unregister("before-sign.ec2.TerminateInstances", mark)
