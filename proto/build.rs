//! Compiles `ckpt.proto` with the system's `protoc` (Debian: `protobuf-compiler`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=ckpt.proto");
    tonic_prost_build::configure().compile_protos(&["ckpt.proto"], &["."])?;
    Ok(())
}
