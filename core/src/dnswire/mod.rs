//! The DNS wire format, shared by the DNS service (`crate::dns`) and the
//! resolver of proxy host names (`crate::outbound::resolve`): the sans-I/O
//! parts from `kerntun_proto::dnswire`, and reading one length-prefixed
//! message from a stream.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

pub use kerntun_proto::dnswire::{Upstream, UpstreamProto};
pub(crate) use kerntun_proto::dnswire::{frame, length_prefixed, msg};

/// Read one length-prefixed message.
pub(crate) async fn read_frame<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len).await?;
    let mut v = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut v).await?;
    Ok(v)
}
