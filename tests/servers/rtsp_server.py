"""A real RTSP server for the live-camera tests: GStreamer's gst-rtsp-server serving each named mount as a live
MJPEG-over-RTP camera (`videotestsrc is-live=true ! jpegenc ! rtpjpegpay`). Run with the SYSTEM Python (Debian's
python3-gi, gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-good), not the project's venv:

    /usr/bin/python3 tests/servers/rtsp_server.py --port 8554 --fps 10 cam0 cam1

Prints `ready <port>` on stdout once it listens (port 0: a free one); serves until killed.
"""

import argparse
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--size", default="160x120")
    parser.add_argument("mounts", nargs="+")
    args = parser.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    for mount in args.mounts:
        factory = GstRtspServer.RTSPMediaFactory()
        factory.set_launch(
            f"( videotestsrc is-live=true pattern=ball ! video/x-raw,format=I420,width={width},height={height},"
            f"framerate={args.fps}/1 ! jpegenc quality=80 ! rtpjpegpay name=pay0 pt=26 )")
        factory.set_shared(True)  # one pipeline per mount, however many clients
        server.get_mount_points().add_factory(f"/{mount}", factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    print(f"ready {server.get_bound_port()}", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
