//! `accel quantize` and the quantization flags the examples share: transformers'
//! `BitsAndBytesConfig` settings on the command line.

use std::path::PathBuf;

use accel_core::bigmodel::quant::{parse_compute_dtype, BnbQuantizationConfig, QuantType};
use accel_core::{Error, Result};
use clap::Args;

/// Loading linear layers quantized (`--load-in-4bit`, `--load-in-8bit` and the
/// `--bnb-4bit-*` settings), with transformers' defaults.
#[derive(Debug, Clone, Default, Args)]
pub struct QuantFlags {
    /// Linear layers in 4 bits (bitsandbytes' blocks of 64), as
    /// BitsAndBytesConfig(load_in_4bit=True).
    #[arg(long, conflicts_with = "load_in_8bit")]
    pub load_in_4bit: bool,
    /// Linear layers in 8 bits (LLM.int8's int8 rows), as
    /// BitsAndBytesConfig(load_in_8bit=True).
    #[arg(long)]
    pub load_in_8bit: bool,
    /// The 4-bit data type: nf4 or fp4 [default: fp4, as transformers].
    #[arg(long, requires = "load_in_4bit")]
    pub bnb_4bit_quant_type: Option<String>,
    /// Quantize the 4-bit blocks' maxima again (8 bits, blocks of 256).
    #[arg(long, requires = "load_in_4bit")]
    pub bnb_4bit_use_double_quant: bool,
    /// The dtype 4-bit layers multiply in: float32, bfloat16 or float16 [default: float32].
    #[arg(long, requires = "load_in_4bit")]
    pub bnb_4bit_compute_dtype: Option<String>,
}

impl QuantFlags {
    /// The settings the flags ask for, `None` without `--load-in-*`.
    ///
    /// # Errors
    /// A quant type or compute dtype that does not exist, naming the flag.
    pub fn config(&self) -> Result<Option<BnbQuantizationConfig>> {
        if self.load_in_8bit {
            return Ok(Some(BnbQuantizationConfig::eight_bit()));
        }
        if !self.load_in_4bit {
            return Ok(None);
        }
        let usage = |flag: &str, reason: String| Error::Usage(format!("{flag}: {reason}"));
        let mut c = BnbQuantizationConfig::four_bit(QuantType::Fp4);
        if let Some(t) = &self.bnb_4bit_quant_type {
            c.bnb_4bit_quant_type =
                QuantType::parse(t).map_err(|e| usage("--bnb-4bit-quant-type", e))?;
        }
        if let Some(d) = &self.bnb_4bit_compute_dtype {
            c.bnb_4bit_compute_dtype = parse_compute_dtype(d).ok_or_else(|| {
                usage(
                    "--bnb-4bit-compute-dtype",
                    format!("{d:?} is not float32, bfloat16 or float16"),
                )
            })?;
        }
        c.bnb_4bit_use_double_quant = self.bnb_4bit_use_double_quant;
        Ok(Some(c))
    }
}

/// Arguments of `accel quantize`.
#[derive(Debug, Clone, Args)]
pub struct QuantizeArgs {
    /// The full-precision Hugging Face folder (config.json and safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Folder to write the quantized model into (transformers' from_pretrained loads it).
    #[arg(long)]
    pub out: PathBuf,
    /// How to quantize (one of --load-in-4bit and --load-in-8bit is required).
    #[command(flatten)]
    pub quant: QuantFlags,
    /// Largest file before the weights are split into shards with an index.
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
}

/// Writes the quantized folder and returns the files written.
///
/// # Errors
/// Neither width asked for; those of [`accel_core::model::quantize_pretrained`].
pub fn quantize(args: &QuantizeArgs) -> Result<Vec<PathBuf>> {
    let Some(config) = args.quant.config()? else {
        return Err(Error::Usage(
            "accel quantize: give --load-in-4bit or --load-in-8bit".into(),
        ));
    };
    accel_core::model::quantize_pretrained(&args.model, &args.out, &config, &args.max_shard_size)
}
