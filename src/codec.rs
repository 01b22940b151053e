//! The gRPC codec of the generated gRPC code (the upstream client, CSDS): prost with small initial
//! buffers. tonic's default allocates 8 KiB per direction per stream up front; with thousands of
//! mostly idle streams that dominates memory, while large responses grow the buffer as needed.
//! (The xDS services read and write their streams themselves: `downstream::requests`,
//! `downstream::services`.)

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial encode/decode buffer per stream. Most xDS requests and incremental responses fit.
const BUFFER_SIZE: usize = 1024;
/// Flush encoded data to HTTP/2 once this much is buffered (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct XdsCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for XdsCodec<T, U> {
    fn default() -> Self {
        XdsCodec(PhantomData)
    }
}

impl<T, U> Codec for XdsCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD))
    }
}
