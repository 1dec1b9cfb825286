from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb


async def test_generate_streams_states_then_tokens(stub):
    req = spb.GenerateRequest(text="hello", stopping=pb.StoppingParams(max_new_tokens=5, ignore_eos=True))
    msgs = [m async for m in stub.Generate(req)]
    states = [m.state for m in msgs if m.state]
    assert states == [pb.GENERATE_STATE_QUEUED, pb.GENERATE_STATE_SCHEDULED, pb.GENERATE_STATE_PREFILLED,
                      pb.GENERATE_STATE_GENERATING]
    assert msgs[-1].HasField("usage") and msgs[-1].usage.completion_tokens == 5
