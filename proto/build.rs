//! Generates the tonic/prost code for every `.proto` under `pagoda/`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["pagoda/worker.proto", "pagoda/kvstore.proto", "pagoda/transfer.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().build_client(true).build_server(true).compile_protos(&protos, &["."])?;
    Ok(())
}
